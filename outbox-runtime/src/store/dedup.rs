//! Dedup mode's SQL (`processed_event`, a row per event and handler key): the source locks a
//! batch takes, and the inserts that say which (event, handler) pairs are new, a batch's at
//! once or one pair behind its savepoint. Which pairs, in which transactions and when is
//! `inbox/batch.rs`'s.

use sqlx::PgConnection;
use uuid::Uuid;

use super::{lease, source_lock};
use crate::error::Result;

/// The condition that leaves the partitions made ahead out of a dedup check (pruned at the
/// executor's start, not probed per pair): a record that the check must see was committed
/// before the checking statement began (before the batch got the lock, or before the
/// statement's snapshot), and its `processed_at`, its transaction's start, is earlier still,
/// as long as the server's clock does not go back. The hour is a margin for a clock set back,
/// or a failover to a server whose clock is behind.
macro_rules! recorded_by_now {
    ($alias:literal) => {
        concat!(
            $alias,
            ".processed_at <= statement_timestamp() + interval '1 hour'"
        )
    };
}

/// Whether `processed_event` holds event `event_id`, for any handler: RabbitMQ's consumer asks
/// it of a redelivered message's predecessor.
#[cfg(feature = "rabbitmq")]
pub(crate) async fn holds(pool: &sqlx::PgPool, event_id: Uuid) -> Result<bool> {
    Ok(
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM processed_event WHERE event_id = $1)")
            .bind(event_id)
            .fetch_one(pool)
            .await?,
    )
}

/// First key of the advisory locks [`lock_sources`] takes ("DEDU").
const SOURCE_LOCK: i32 = 0x4445_4455;

/// Takes a dedup batch's source locks ([`source_lock::lock`]), in `conn`'s transaction:
/// `sources` name each handler key, topic and partition of the batch's messages. With a
/// `fence` (group, topic, holder), checks in the same statement (one round trip) that the
/// holder owns the lease and holds its row ([`lease::owned_sql`]); `false` if it does not (the
/// caller rolls back: the locks go with the transaction).
pub(crate) async fn lock_sources(
    conn: &mut PgConnection,
    sources: &[String],
    fence: Option<(&str, &str, Uuid)>,
) -> Result<bool> {
    let Some((group, topic, holder)) = fence else {
        if !sources.is_empty() {
            source_lock::lock(conn, SOURCE_LOCK, sources).await?;
        }
        return Ok(true);
    };
    // The fence first: the subqueries run in the order of the select list.
    let owned: bool = sqlx::query_scalar(concat!(
        "SELECT EXISTS (",
        lease::owned_sql!(),
        "), (",
        source_lock::locks_sql!("$4", "$5"),
        ")"
    ))
    .bind(group)
    .bind(topic)
    .bind(holder)
    .bind(SOURCE_LOCK)
    .bind(sources)
    .fetch_one(conn)
    .await?;
    Ok(owned)
}

/// Inserts the pairs (`event_ids[i]`, `handlers[i]`) that no partition of `processed_event`
/// holds yet (the partitions made ahead left out: see `recorded_by_now`), in one statement;
/// returns the pairs it inserted (each once, however often the batch holds it).
pub(crate) async fn insert_new(
    conn: &mut PgConnection,
    event_ids: &[Uuid],
    handlers: &[&str],
) -> Result<Vec<(Uuid, String)>> {
    // The check probes each partition's key index once per pair (`OFFSET 0` keeps it a
    // subplan: pulled up into an anti-join, the planner may hash the whole table, every batch,
    // when its statistics are stale or missing), except the partitions made ahead: see
    // `recorded_by_now`.
    let new: Vec<(Uuid, String)> = sqlx::query_as(concat!(
        "INSERT INTO processed_event (event_id, handler) \
         SELECT x.e, x.h FROM unnest($1::uuid[], $2::text[]) AS x(e, h) \
         WHERE NOT EXISTS (SELECT 1 FROM processed_event p \
                           WHERE p.event_id = x.e AND p.handler = x.h AND ",
        recorded_by_now!("p"),
        " OFFSET 0) \
         ON CONFLICT DO NOTHING \
         RETURNING event_id, handler"
    ))
    .bind(event_ids)
    .bind(handlers)
    .fetch_all(conn)
    .await?;
    Ok(new)
}

/// Inserts the pair (`event_id`, `handler`) if no partition of `processed_event` holds it yet
/// (the partitions made ahead left out); `true` if it inserted it.
pub(crate) async fn insert_one(
    conn: &mut PgConnection,
    event_id: Uuid,
    handler: &str,
) -> Result<bool> {
    let inserted = sqlx::query(concat!(
        "INSERT INTO processed_event (event_id, handler) SELECT $1::uuid, $2::text \
         WHERE NOT EXISTS (SELECT 1 FROM processed_event p \
                           WHERE p.event_id = $1 AND p.handler = $2 AND ",
        recorded_by_now!("p"),
        ") ON CONFLICT DO NOTHING"
    ))
    .bind(event_id)
    .bind(handler)
    .execute(conn)
    .await?
    .rows_affected();
    Ok(inserted == 1)
}
