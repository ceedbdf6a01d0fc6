//! What the processors' floor is computed from (see `inbox/floor.rs`): the receipts' sequence
//! as far as it was drawn, and a snapshot's bounds with the oldest row still to process.

use sqlx::PgPool;

use crate::error::Result;

/// A look at the inbox, by one statement's snapshot.
pub(crate) struct Look {
    /// The oldest transaction still running (`pg_snapshot_xmin`).
    pub xmin: i64,
    /// The first transaction id not yet assigned (`pg_snapshot_xmax`).
    pub xmax: i64,
    /// The lowest `seq` of a row unprocessed and not dead (`None`: none).
    pub oldest: Option<i64>,
}

/// How far the receipts have drawn `inbox_event_seq` (`None`: never). Not transactional: a
/// value drawn by a transaction that has not committed counts.
pub(crate) async fn drawn(pool: &PgPool) -> Result<Option<i64>> {
    Ok(
        sqlx::query_scalar("SELECT pg_sequence_last_value('inbox_event_seq')")
            .fetch_one(pool)
            .await?,
    )
}

/// A [`Look`], by a statement of its own (so its snapshot begins after whatever was read
/// before).
pub(crate) async fn look(pool: &PgPool) -> Result<Look> {
    let (xmin, xmax, oldest): (i64, i64, Option<i64>) = sqlx::query_as(
        "SELECT pg_snapshot_xmin(s)::text::int8, pg_snapshot_xmax(s)::text::int8, \
                (SELECT min(seq) FROM inbox_event WHERE NOT processed AND dead_at IS NULL) \
         FROM pg_current_snapshot() AS s",
    )
    .fetch_one(pool)
    .await?;
    Ok(Look { xmin, xmax, oldest })
}
