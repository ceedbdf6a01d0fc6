//! The relay's SQL: shard ownership, claiming, marking, failures, status.

use std::collections::BTreeSet;

use sqlx::postgres::PgRow;
use sqlx::{Executor, PgConnection, Row};

use crate::error::Result;

/// Keys are spread over this many shards by `hashtext(partition_key) & 63`; each shard is
/// published by one relay instance at a time, so one key's events go out in `id` order.
pub(crate) const SHARDS: i32 = 64;

/// Advisory lock namespaces (first key of the two-key form).
use crate::admin::status::RELAY_MEMBER_LOCK as MEMBER_LOCK; // key2 = member slot
const SHARD_LOCK: i32 = 0x6f62_7873; // "obxs": key2 = shard
const MEMBER_SLOTS: i32 = 4096;

/// One claimed outbox row.
#[derive(Debug)]
pub(crate) struct Claimed {
    pub id: i64,
    pub event_id: uuid::Uuid,
    pub topic: String,
    pub partition_key: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub payload: String,
    pub attempts: i32,
    pub created_at_ms: i64,
}

/// Takes a member slot (a session advisory lock held while the instance lives), so that every
/// instance can count the live ones. Returns the slot.
pub(crate) async fn join(conn: &mut PgConnection) -> Result<Option<i32>> {
    let slot: Option<i32> = sqlx::query_scalar(
        "SELECT s FROM generate_series(0, $2 - 1) AS s \
         WHERE pg_try_advisory_lock($1, s) LIMIT 1",
    )
    .bind(MEMBER_LOCK)
    .bind(MEMBER_SLOTS)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(slot)
}

/// Registers (or unregisters) this instance as waiting for work: while any instance waits,
/// emitters send NOTIFY.
pub(crate) async fn set_waiting(conn: &mut PgConnection, slot: i32, waiting: bool) -> Result<()> {
    let sql = if waiting {
        "INSERT INTO outbox_relay_waiting (slot) VALUES ($1) ON CONFLICT DO NOTHING"
    } else {
        "DELETE FROM outbox_relay_waiting WHERE slot = $1"
    };
    sqlx::query(sql).bind(slot).execute(&mut *conn).await?;
    Ok(())
}

/// Removes the waiting marks of instances that are gone (their member lock is free), and any
/// left under `slot` by its previous holder.
pub(crate) async fn clear_stale_waiting(conn: &mut PgConnection, slot: i32) -> Result<()> {
    sqlx::query(
        "DELETE FROM outbox_relay_waiting w WHERE w.slot = $2 OR NOT EXISTS ( \
             SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
               AND l.classid = $1::int8::oid AND l.objid = w.slot::int8::oid AND l.objsubid = 2 \
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))",
    )
    .bind(MEMBER_LOCK)
    .bind(slot)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(crate) use crate::admin::status::relay_members as members;

/// Moves `owned` toward this instance's fair share of the shards: releases extras, takes free
/// ones. Called only between batches, so a released shard has nothing in flight.
pub(crate) async fn rebalance(
    conn: &mut PgConnection,
    owned: &mut BTreeSet<i32>,
    slot: i32,
) -> Result<()> {
    let members = members(conn).await?.max(1);
    let target = ((SHARDS as i64 + members - 1) / members) as usize;
    if owned.len() > target {
        let extra: Vec<i32> = owned
            .iter()
            .rev()
            .take(owned.len() - target)
            .copied()
            .collect();
        sqlx::query("SELECT pg_advisory_unlock($1, s) FROM unnest($2::int4[]) AS s")
            .bind(SHARD_LOCK)
            .bind(&extra)
            .execute(&mut *conn)
            .await?;
        for s in extra {
            owned.remove(&s);
        }
    } else if owned.len() < target {
        // Start from a place that depends on the slot, so instances try different shards.
        let start = (slot * 17).rem_euclid(SHARDS);
        let candidates: Vec<i32> = (0..SHARDS)
            .map(|i| (start + i) % SHARDS)
            .filter(|s| !owned.contains(s))
            .collect();
        let got: Vec<i32> = sqlx::query_scalar(
            "SELECT s FROM unnest($2::int4[]) AS s WHERE pg_try_advisory_lock($1, s)",
        )
        .bind(SHARD_LOCK)
        .bind(&candidates)
        .fetch_all(&mut *conn)
        .await?;
        let need = target - owned.len();
        let (keep, give_back) = got.split_at(got.len().min(need));
        owned.extend(keep);
        if !give_back.is_empty() {
            sqlx::query("SELECT pg_advisory_unlock($1, s) FROM unnest($2::int4[]) AS s")
                .bind(SHARD_LOCK)
                .bind(give_back)
                .execute(&mut *conn)
                .await?;
        }
    }
    Ok(())
}

/// The columns a [`Claimed`] is read from (table alias `o`).
macro_rules! claimed_columns {
    () => {
        "o.id, o.event_id, o.topic, o.partition_key, o.aggregate_type, o.aggregate_id, \
         o.event_type, o.payload::text AS payload, o.attempts, \
         (extract(epoch FROM o.created_at) * 1000)::int8 AS created_at_ms"
    };
}
pub(crate) use claimed_columns;

impl Claimed {
    /// Reads a row selected with [`claimed_columns!`].
    pub(crate) fn from_row(r: &PgRow) -> Result<Claimed> {
        Ok(Claimed {
            id: r.try_get("id")?,
            event_id: r.try_get("event_id")?,
            topic: r.try_get("topic")?,
            partition_key: r.try_get("partition_key")?,
            aggregate_type: r.try_get("aggregate_type")?,
            aggregate_id: r.try_get("aggregate_id")?,
            event_type: r.try_get("event_type")?,
            payload: r.try_get("payload")?,
            attempts: r.try_get("attempts")?,
            created_at_ms: r.try_get("created_at_ms")?,
        })
    }
}

pub(crate) const CLAIM_SQL: &str = concat!(
    "SELECT ",
    claimed_columns!(),
    " \
FROM outbox_event o \
WHERE o.published_at IS NULL AND o.parked_at IS NULL \
  AND (hashtext(o.partition_key) & 63) = ANY($1::int4[]) \
  AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now()) \
  AND NOT EXISTS ( \
      SELECT 1 FROM outbox_event b \
      WHERE b.published_at IS NULL AND b.next_attempt_at IS NOT NULL \
        AND b.parked_at IS NULL AND b.next_attempt_at > now() \
        AND b.partition_key = o.partition_key AND b.id < o.id) \
ORDER BY o.id \
LIMIT $2 \
FOR UPDATE OF o SKIP LOCKED"
);

/// Begins the batch's transaction and claims up to `limit` rows of the owned shards, in `id`
/// order, skipping keys with an earlier record waiting for a retry.
pub(crate) async fn claim(
    conn: &mut PgConnection,
    shards: &BTreeSet<i32>,
    limit: i64,
) -> Result<Vec<Claimed>> {
    conn.execute("BEGIN").await?;
    let shards: Vec<i32> = shards.iter().copied().collect();
    let rows = sqlx::query(CLAIM_SQL)
        .bind(&shards)
        .bind(limit)
        .fetch_all(&mut *conn)
        .await?;
    rows.iter().map(Claimed::from_row).collect()
}

/// A record the broker refused for good.
pub(crate) struct Failure {
    pub id: i64,
    pub error: String,
    /// Seconds until the next attempt.
    pub backoff_secs: f64,
}

/// Records the batch's outcome and commits: `published` rows get `published_at`, `failed`
/// rows an attempt (and are parked at `max_attempts`). Returns how many rows were parked.
pub(crate) async fn finish(
    conn: &mut PgConnection,
    published: &[i64],
    failed: &[Failure],
    max_attempts: i32,
) -> Result<u64> {
    let mut parked = 0;
    if !failed.is_empty() {
        let ids: Vec<i64> = failed.iter().map(|f| f.id).collect();
        let errors: Vec<&str> = failed.iter().map(|f| f.error.as_str()).collect();
        let backoffs: Vec<f64> = failed.iter().map(|f| f.backoff_secs).collect();
        let rows = sqlx::query(
            "UPDATE outbox_event o SET attempts = o.attempts + 1, last_error = f.error, \
                 next_attempt_at = now() + make_interval(secs => f.backoff), \
                 parked_at = CASE WHEN o.attempts + 1 >= $4 THEN now() END \
             FROM unnest($1::int8[], $2::text[], $3::float8[]) AS f(id, error, backoff) \
             WHERE o.id = f.id RETURNING o.parked_at IS NOT NULL AS parked",
        )
        .bind(&ids)
        .bind(&errors)
        .bind(&backoffs)
        .bind(max_attempts)
        .fetch_all(&mut *conn)
        .await?;
        for row in rows {
            if row.try_get::<bool, _>("parked")? {
                parked += 1;
            }
        }
    }
    // The ids are integers: a literal array is exact, and lets the update and COMMIT share one
    // round trip.
    let mut sql = String::with_capacity(published.len() * 12 + 128);
    if !published.is_empty() {
        sql.push_str(
            "UPDATE outbox_event SET published_at = now(), next_attempt_at = NULL \
             WHERE id = ANY('{",
        );
        for (i, id) in published.iter().enumerate() {
            if i > 0 {
                sql.push(',');
            }
            sql.push_str(&id.to_string());
        }
        sql.push_str("}'::int8[]); ");
    }
    sql.push_str("COMMIT");
    conn.execute(sql.as_str()).await?;
    Ok(parked)
}

/// Ends a batch without recording anything.
pub(crate) async fn abandon(conn: &mut PgConnection) -> Result<()> {
    conn.execute("ROLLBACK").await?;
    Ok(())
}
