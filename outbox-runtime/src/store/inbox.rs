//! Inbox mode's SQL (`inbox_event`, a row per event): the receipt (with its per-row
//! fallback for what `jsonb` refuses) under its source locks, the processors' claim of due
//! rows in their keys' order ([`claim`]), marking them processed or failed, and the backlog
//! figures ([`inbox_status`]). Their
//! callers decide when: `inbox/receive.rs` (the receipt, waiting out the database's failures)
//! and `inbox/processor.rs` (the processors' transactions, down their ladder).

use std::time::Duration;

use sqlx::{PgPool, Row as _};
use uuid::Uuid;

#[cfg(feature = "testing")]
pub(crate) use claim::explain as explain_claim;
pub(crate) use claim::{claim, due_ids, planner_restore, Scope, BEGIN_SQL};

use super::source_lock;
use crate::error::Result;
use crate::sqlstate::DbError;

mod claim;
pub(crate) mod floor;

/// A checked message, ready to store in the inbox.
pub(crate) struct InboxRow<'m> {
    pub event_id: Uuid,
    pub topic: &'m str,
    pub event_type: String,
    pub partition_key: Option<String>,
    pub partition: i32,
    pub offset: i64,
    pub payload: &'m [u8],
    /// The application's headers as a JSON object (`None`: none).
    pub headers: Option<String>,
    pub schema_version: u32,
}

/// What [`receive`] did.
#[derive(Debug, Default)]
pub(crate) struct Received {
    /// Rows new to the inbox.
    pub new: u64,
    /// Rows PostgreSQL refused (by index): a payload `jsonb` cannot hold. The dead-letter
    /// reason.
    pub refused: Vec<(usize, String)>,
}

/// Stores the messages (one statement; duplicates ignored). If PostgreSQL refuses the data (a
/// payload that is JSON to serde but not to `jsonb`: a lone surrogate escape, `\u0000`, a
/// number beyond `numeric`), stores them one by one, so that only the refused ones are left out.
/// An error is the database's.
pub(crate) async fn receive(pool: &PgPool, rows: &[InboxRow<'_>]) -> Result<Received> {
    match insert(pool, rows).await {
        Ok(new) => Ok(Received {
            new,
            refused: Vec::new(),
        }),
        Err(e) if DbError::of(&e) == DbError::Data => {
            let mut received = Received::default();
            for (i, row) in rows.iter().enumerate() {
                match insert(pool, std::slice::from_ref(row)).await {
                    Ok(new) => received.new += new,
                    Err(e) if DbError::of(&e) == DbError::Data => received
                        .refused
                        .push((i, format!("PostgreSQL refuses the payload as jsonb: {e}"))),
                    Err(e) => return Err(e.into()),
                }
            }
            Ok(received)
        }
        Err(e) => Err(e.into()),
    }
}

/// The receipt's insert: the rows (`$1` ids, `$2` topics, `$3` event types, `$4` keys, `$5`
/// payloads, `$6` headers, `$7` partitions, `$8` offsets, `$9` schema versions) no partition
/// holds yet, in their order. The absence check probes each partition's key index once per
/// row (`OFFSET 0` keeps it a subplan: pulled up into an anti-join, a plan made while the
/// partition was small, or on stale statistics, hashes the whole partition every receipt).
const RECEIPT_SQL: &str = "INSERT INTO inbox_event (event_id, topic, event_type, partition_key, \
         payload, headers, source_partition, source_offset, schema_version) \
     SELECT r.id, r.topic, r.event_type, r.partition_key, r.payload::jsonb, \
         coalesce(r.headers::jsonb, '{}'), r.part, r.off, r.version \
     FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], \
         $7::int4[], $8::int8[], $9::int8[]) \
         WITH ORDINALITY AS r(id, topic, event_type, partition_key, payload, headers, part, \
             off, version, n) \
     WHERE NOT EXISTS (SELECT 1 FROM inbox_event i WHERE i.event_id = r.id \
         AND i.received_at <= statement_timestamp() + interval '1 hour' OFFSET 0) \
     ORDER BY r.n \
     ON CONFLICT DO NOTHING";

/// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` of a receipt of one new row, on a connection that
/// prepared the receipt's insert and planned it once (a generic plan, as a connection's
/// prepared statement gets after a few executions), before and after `between` (rolled back).
#[cfg(feature = "testing")]
pub(crate) async fn explain_receipt(
    pool: &PgPool,
    between: impl std::future::Future<Output = ()>,
) -> Result<(serde_json::Value, serde_json::Value)> {
    use sqlx::Connection as _;
    let mut conn = pool.acquire().await?;
    sqlx::raw_sql(&format!(
        "SET plan_cache_mode = force_generic_plan; PREPARE receipt AS {RECEIPT_SQL}"
    ))
    .execute(&mut *conn)
    .await?;
    let explain = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE receipt(\
        ARRAY[gen_random_uuid()], ARRAY['payment.events'], ARRAY['PaymentSucceeded'], \
        ARRAY['acct-1'], ARRAY['{}'], ARRAY[NULL::text], ARRAY[0], ARRAY[1::int8], ARRAY[1::int8])";
    let explained = async |conn: &mut sqlx::PgConnection| -> Result<serde_json::Value> {
        let mut tx = conn.begin().await?;
        let plan = sqlx::query_scalar(explain).fetch_one(&mut *tx).await?;
        tx.rollback().await?;
        Ok(plan)
    };
    // Planned now, with the table as it is: the plan stays cached for the second.
    let before = explained(&mut conn).await?;
    between.await;
    let after = explained(&mut conn).await?;
    sqlx::raw_sql("DEALLOCATE receipt; RESET plan_cache_mode")
        .execute(&mut *conn)
        .await?;
    Ok((before, after))
}

/// First key of the advisory locks [`insert`] takes ("INBX"; see [`source_lock`]).
const RECEIPT_LOCK: i32 = 0x494E_4258;

/// Stores the rows no partition holds yet, in one transaction at READ COMMITTED (whatever the
/// role's default) that first takes a transaction-scoped advisory lock per source topic and
/// partition (in one order, so two receipts never deadlock). What keeps an event stored once
/// when `inbox_event` is partitioned (its key then holds `received_at`, so two rows of one
/// event would not conflict): the same message in two consumers at once (one the group
/// replaced, finishing its batch) takes the same lock, so the second waits for the first to
/// end, and its insert, a statement that starts after that, sees the first's row in whichever
/// partition and skips it. On an unpartitioned table the key does it too. A row cannot have
/// been received after the statement began: the probe leaves out the partitions ahead (an
/// hour's margin for a clock set back).
async fn insert(pool: &PgPool, rows: &[InboxRow<'_>]) -> std::result::Result<u64, sqlx::Error> {
    if rows.is_empty() {
        return Ok(0);
    }
    let sources: std::collections::BTreeSet<String> = rows
        .iter()
        .map(|r| format!("{}\u{1f}{}", r.topic, r.partition))
        .collect();
    let sources: Vec<String> = sources.into_iter().collect();
    let mut tx = source_lock::begin(pool).await?;
    source_lock::lock(&mut tx, RECEIPT_LOCK, &sources).await?;
    let ids: Vec<Uuid> = rows.iter().map(|r| r.event_id).collect();
    let topics: Vec<&str> = rows.iter().map(|r| r.topic).collect();
    let types: Vec<&str> = rows.iter().map(|r| r.event_type.as_str()).collect();
    let keys: Vec<Option<&str>> = rows.iter().map(|r| r.partition_key.as_deref()).collect();
    let payloads: Vec<String> = rows
        .iter()
        .map(|r| String::from_utf8_lossy(r.payload).into_owned())
        .collect();
    let headers: Vec<Option<&str>> = rows.iter().map(|r| r.headers.as_deref()).collect();
    let partitions: Vec<i32> = rows.iter().map(|r| r.partition).collect();
    let offsets: Vec<i64> = rows.iter().map(|r| r.offset).collect();
    let versions: Vec<i64> = rows.iter().map(|r| i64::from(r.schema_version)).collect();
    let result = sqlx::query(RECEIPT_SQL)
        .bind(&ids)
        .bind(&topics)
        .bind(&types)
        .bind(&keys)
        .bind(&payloads)
        .bind(&headers)
        .bind(&partitions)
        .bind(&offsets)
        .bind(&versions)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(result.rows_affected())
}

/// A claimed inbox row.
pub(crate) struct Claimed {
    pub(crate) event_id: Uuid,
    pub(crate) topic: String,
    pub(crate) event_type: String,
    pub(crate) payload: String,
    pub(crate) attempts: i32,
    pub(crate) partition_key: Option<String>,
    pub(crate) partition: Option<i32>,
    pub(crate) offset: Option<i64>,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) schema_version: i64,
    pub(crate) received_at: ReceivedAt,
}

/// When a row was received (`received_at`, what `inbox_event` is partitioned by).
pub(crate) type ReceivedAt = chrono::DateTime<chrono::Utc>;

/// A claimed row, from the claim's statement.
fn claimed(r: &sqlx::postgres::PgRow) -> Result<Claimed> {
    Ok(Claimed {
        event_id: r.try_get("event_id")?,
        topic: r.try_get("topic")?,
        event_type: r.try_get("event_type")?,
        payload: r.try_get("payload")?,
        attempts: r.try_get("attempts")?,
        partition_key: r.try_get("partition_key")?,
        partition: r.try_get("source_partition")?,
        offset: r.try_get("source_offset")?,
        headers: headers_from_json(r.try_get::<Option<String>, _>("headers")?.as_deref()),
        schema_version: r.try_get("schema_version")?,
        received_at: r.try_get("received_at")?,
    })
}

/// Marks rows processed (`processed`, `processed_at`, no retry pending). Planned each time,
/// never prepared: a plan a connection kept from while the day's partition was small scans it
/// whole, however large it has grown (the generic plan PostgreSQL settles on after a few
/// executions; only an `ANALYZE` of the partition replaces it). Sent as one simple query with
/// the ids and times written in (uuids and timestamps we format, nothing of the user's): a
/// round trip, as a prepared statement's, where an unprepared one with parameters takes two.
/// The rows' `received_at` leaves out, as it is planned, the partitions that cannot hold them.
pub(crate) async fn mark_processed(
    conn: &mut sqlx::PgConnection,
    done: &[(Uuid, ReceivedAt)],
) -> Result<()> {
    let (Some(first), Some(last)) = (
        done.iter().map(|(_, at)| *at).min(),
        done.iter().map(|(_, at)| *at).max(),
    ) else {
        return Ok(());
    };
    let ids: Vec<String> = done.iter().map(|(id, _)| id.to_string()).collect();
    let at = |t: ReceivedAt| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let sql = format!(
        "UPDATE inbox_event SET processed = true, processed_at = now(), next_attempt_at = NULL \
         WHERE event_id = ANY('{{{}}}'::uuid[]) \
           AND received_at BETWEEN '{}'::timestamptz AND '{}'::timestamptz",
        ids.join(","),
        at(first),
        at(last)
    );
    // Without arguments, sqlx sends it as a simple query.
    sqlx::Executor::execute(conn, sql.as_str()).await?;
    Ok(())
}

/// A row's failure, to record: the error, the wait before its next attempt, whether it is dead.
pub(crate) struct RowFailure {
    pub(crate) event_id: Uuid,
    pub(crate) error: String,
    pub(crate) backoff_secs: f64,
    pub(crate) dead: bool,
}

/// Records failures: an attempt more, the error (`last_error`), when to try again
/// (`next_attempt_at`); `dead_at` if `dead`.
pub(crate) async fn record_failures(
    conn: &mut sqlx::PgConnection,
    failed: &[RowFailure],
) -> Result<()> {
    if failed.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = failed.iter().map(|f| f.event_id).collect();
    let errors: Vec<&str> = failed.iter().map(|f| f.error.as_str()).collect();
    let backoffs: Vec<f64> = failed.iter().map(|f| f.backoff_secs).collect();
    let dead: Vec<bool> = failed.iter().map(|f| f.dead).collect();
    sqlx::query(
        "UPDATE inbox_event i SET attempts = i.attempts + 1, last_error = f.error, \
             next_attempt_at = now() + make_interval(secs => f.backoff), \
             dead_at = CASE WHEN f.dead THEN now() END \
         FROM unnest($1::uuid[], $2::text[], $3::float8[], $4::bool[]) \
             AS f(id, error, backoff, dead) \
         WHERE i.event_id = f.id",
    )
    .persistent(false)
    .bind(&ids)
    .bind(&errors)
    .bind(&backoffs)
    .bind(&dead)
    .execute(conn)
    .await?;
    Ok(())
}

/// Whether `inbox_event` holds event `event_id` (received, whatever became of it since):
/// RabbitMQ's consumer asks it of a redelivered message's predecessor.
#[cfg(feature = "rabbitmq")]
pub(crate) async fn holds(pool: &PgPool, event_id: Uuid) -> Result<bool> {
    Ok(
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM inbox_event WHERE event_id = $1)")
            .bind(event_id)
            .fetch_one(pool)
            .await?,
    )
}

/// A row's `attempts` so far.
pub(crate) async fn attempts(conn: &mut sqlx::PgConnection, event_id: Uuid) -> Result<i32> {
    Ok(
        sqlx::query_scalar("SELECT attempts FROM inbox_event WHERE event_id = $1")
            .persistent(false)
            .bind(event_id)
            .fetch_one(conn)
            .await?,
    )
}

/// Inbox backlog figures.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxStatus {
    /// Rows received and not processed yet (not dead).
    pub unprocessed: i64,
    /// Of those, rows that failed and wait for a retry.
    pub retrying: i64,
    /// Dead rows (failed for good; kept).
    pub dead: i64,
    /// Age of the oldest unprocessed row (the processing lag).
    pub oldest_unprocessed_age: Option<Duration>,
    /// Rows in `processed_event` (dedup mode's ledger).
    pub processed_event_rows: i64,
}

/// Inbox backlog figures, from the database alone (one statement over `inbox_event`'s
/// unprocessed rows, and `processed_event`'s count).
pub(crate) async fn inbox_status(pool: &PgPool) -> Result<InboxStatus> {
    let row = sqlx::query(
        "SELECT count(*) FILTER (WHERE dead_at IS NULL) AS unprocessed, \
                count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at IS NOT NULL) AS retrying, \
                count(*) FILTER (WHERE dead_at IS NOT NULL) AS dead, \
                extract(epoch FROM now() - min(received_at) FILTER (WHERE dead_at IS NULL))::float8 AS age, \
                (SELECT count(*) FROM processed_event) AS processed_event_rows \
         FROM inbox_event WHERE NOT processed",
    )
    .fetch_one(pool)
    .await?;
    let age: Option<f64> = row.try_get("age")?;
    Ok(InboxStatus {
        unprocessed: row.try_get("unprocessed")?,
        retrying: row.try_get("retrying")?,
        dead: row.try_get("dead")?,
        oldest_unprocessed_age: age.map(|s| Duration::from_secs_f64(s.max(0.0))),
        processed_event_rows: row.try_get("processed_event_rows")?,
    })
}

/// A message's headers (the application's: its metadata's) as a JSON object for its inbox
/// row's `headers` (`None`: it has none). Of a header given twice, the first counts.
pub(crate) fn headers_json(headers: &[(&str, &[u8])]) -> Option<String> {
    if headers.is_empty() {
        return None;
    }
    let mut object = serde_json::Map::new();
    for (name, value) in headers {
        object
            .entry(*name)
            .or_insert_with(|| String::from_utf8_lossy(value).into_owned().into());
    }
    Some(serde_json::Value::Object(object).to_string())
}

/// The headers of an inbox row (its `headers`, the JSON object [`headers_json`] made), by name.
fn headers_from_json(json: Option<&str>) -> Vec<(String, String)> {
    let Some(json) = json else {
        return Vec::new();
    };
    let object: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(json).unwrap_or_default();
    object
        .into_iter()
        .map(|(name, value)| {
            let value = match value {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            (name, value)
        })
        .collect()
}
