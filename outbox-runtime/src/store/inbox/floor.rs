//! What the processors' floor is computed from (see `inbox/floor.rs`): the receipts' sequence
//! as far as it was drawn, the transactions running in this database, and the oldest row still
//! to process. Each a statement of its own: the floor's reasoning depends on their order.

use sqlx::PgConnection;

use crate::error::Result;

/// How far the receipts have drawn `inbox_event_seq` (`None`: never). Not transactional: a
/// value drawn by a transaction that has not committed counts.
pub(crate) async fn drawn(conn: &mut PgConnection) -> Result<Option<i64>> {
    Ok(
        sqlx::query_scalar("SELECT pg_sequence_last_value('inbox_event_seq')")
            .fetch_one(conn)
            .await?,
    )
}

/// The transactions running now in this database, but this session's: their virtual ids,
/// which each holds from its start to its end (`pg_locks`, which every role can read).
pub(crate) async fn running(conn: &mut PgConnection) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT ARRAY(SELECT l.virtualxid FROM pg_locks l \
                      JOIN pg_stat_activity a ON a.pid = l.pid \
                      WHERE l.locktype = 'virtualxid' AND l.granted \
                        AND l.mode = 'ExclusiveLock' AND l.pid <> pg_backend_pid() \
                        AND a.datname = current_database())",
    )
    .fetch_one(conn)
    .await?)
}

/// Whether every one of `these` transactions (virtual ids) has ended.
pub(crate) async fn ended(conn: &mut PgConnection, these: &[String]) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT NOT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'virtualxid' \
                            AND granted AND virtualxid = ANY($1))",
    )
    .bind(these)
    .fetch_one(conn)
    .await?)
}

/// The lowest `seq` of a row unprocessed and not dead (`None`: none).
pub(crate) async fn oldest(conn: &mut PgConnection) -> Result<Option<i64>> {
    Ok(sqlx::query_scalar(
        "SELECT min(seq) FROM inbox_event WHERE NOT processed AND dead_at IS NULL",
    )
    .fetch_one(conn)
    .await?)
}
