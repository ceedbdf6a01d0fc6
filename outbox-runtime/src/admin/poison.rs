//! Poison events: parked outbox rows and dead inbox rows, listed, retried or dropped.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::{PgPool, Postgres, Row};
use uuid::Uuid;

use crate::error::Result;

/// Which poison rows an operation applies to: all of them by default, narrowed by topic, event
/// type and ids (any of the ids given), the oldest first, at most `limit`. What
/// [`list_parked`] shows for a filter is what [`retry_parked`] and [`drop_parked`] act on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[must_use]
pub struct PoisonFilter {
    pub(super) topic: Option<String>,
    pub(super) event_type: Option<String>,
    pub(super) ids: Vec<i64>,
    pub(super) event_ids: Vec<Uuid>,
    pub(super) limit: Option<i64>,
    pub(super) since: Option<DateTime<Utc>>,
    pub(super) until: Option<DateTime<Utc>>,
    pub(super) after_id: Option<i64>,
    pub(super) after_received: Option<(DateTime<Utc>, Uuid)>,
}

impl PoisonFilter {
    /// Every poison row.
    pub fn all() -> Self {
        Self::default()
    }

    /// Rows of this topic only.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }

    /// Rows of this event type only.
    pub fn event_type(mut self, event_type: impl Into<String>) -> Self {
        self.event_type = Some(event_type.into());
        self
    }

    /// The outbox row with this `id` (outbox rows only; with [`event_id`](Self::event_id),
    /// rows matching either).
    pub fn id(mut self, id: i64) -> Self {
        self.ids.push(id);
        self
    }

    /// The row with this event id.
    pub fn event_id(mut self, event_id: Uuid) -> Self {
        self.event_ids.push(event_id);
        self
    }

    /// At most this many rows, the oldest first.
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = Some(i64::from(limit));
        self
    }

    /// Rows written (outbox: `created_at`; inbox: `received_at`) at or after this time only.
    pub fn since(mut self, at: DateTime<Utc>) -> Self {
        self.since = Some(at);
        self
    }

    /// Rows written (outbox: `created_at`; inbox: `received_at`) before this time only.
    pub fn until(mut self, at: DateTime<Utc>) -> Self {
        self.until = Some(at);
        self
    }

    /// Outbox rows after this `id` only: the next page of a listing that ended at `id` (the
    /// list is in `id` order). Read through the parked rows' index, so that a page costs the
    /// same on a table with a million parked rows.
    pub fn after_id(mut self, id: i64) -> Self {
        self.after_id = Some(id);
        self
    }

    /// Inbox rows after this one in the dead list's order (`received_at`, then `event_id`)
    /// only: the next page of a listing that ended at that row.
    pub fn after_received(mut self, received_at: DateTime<Utc>, event_id: Uuid) -> Self {
        self.after_received = Some((received_at, event_id));
        self
    }

    /// Binds `$1..$10` of [`OUTBOX_SELECT`] / [`INBOX_SELECT`] (each uses the cursor of its
    /// own order and leaves the other's parameters unused); a statement's own parameters
    /// follow from `$11`.
    fn bind<'q>(
        &'q self,
        query: Query<'q, Postgres, PgArguments>,
    ) -> Query<'q, Postgres, PgArguments> {
        query
            .bind(self.topic.as_deref())
            .bind(self.event_type.as_deref())
            .bind(&self.ids)
            .bind(&self.event_ids)
            .bind(self.limit)
            .bind(self.since)
            .bind(self.until)
            .bind(self.after_id)
            .bind(self.after_received.map(|(at, _)| at))
            .bind(self.after_received.map(|(_, id)| id))
    }
}

/// The parked rows a filter selects, as a subquery of ids. Statements that change rows repeat
/// its conditions outside it: a row a concurrent transaction changed (an operator retrying it,
/// say) is checked again only against the outer `WHERE`, once that transaction commits.
const OUTBOX_SELECT: &str = concat!("SELECT id FROM outbox_event WHERE ", outbox_where!());

/// The conditions of [`OUTBOX_SELECT`], and its order and limit.
macro_rules! outbox_where {
    () => {
        "parked_at IS NOT NULL \
  AND ($1::text IS NULL OR topic = $1) AND ($2::text IS NULL OR event_type = $2) \
  AND ((cardinality($3::int8[]) = 0 AND cardinality($4::uuid[]) = 0) \
       OR id = ANY($3) OR event_id = ANY($4)) \
  AND ($6::timestamptz IS NULL OR created_at >= $6) \
  AND ($7::timestamptz IS NULL OR created_at < $7) \
  AND ($8::int8 IS NULL OR id > $8) \
ORDER BY id LIMIT $5"
    };
}
use outbox_where;

/// The dead rows a filter selects, as a subquery of event ids.
const INBOX_SELECT: &str = concat!("SELECT event_id FROM inbox_event WHERE ", inbox_where!());

/// The conditions of [`INBOX_SELECT`], and its order and limit.
macro_rules! inbox_where {
    () => {
        "dead_at IS NOT NULL \
  AND ($1::text IS NULL OR topic = $1) AND ($2::text IS NULL OR event_type = $2) \
  AND ((cardinality($3::int8[]) = 0 AND cardinality($4::uuid[]) = 0) OR event_id = ANY($4)) \
  AND ($6::timestamptz IS NULL OR received_at >= $6) \
  AND ($7::timestamptz IS NULL OR received_at < $7) \
  AND ($9::timestamptz IS NULL OR (received_at, event_id) > ($9, $10::uuid)) \
ORDER BY received_at, event_id LIMIT $5"
    };
}
use inbox_where;

/// A parked outbox row: refused by the broker `max_attempts` times, skipped by the relay.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct ParkedEvent {
    /// The outbox row's id (`outbox_event.id`).
    pub id: i64,
    /// The event's id.
    pub event_id: Uuid,
    /// The Kafka topic it is to be published to.
    pub topic: String,
    /// Its Kafka record key.
    pub partition_key: String,
    /// The aggregate's type.
    pub aggregate_type: String,
    /// The aggregate's id, as text.
    pub aggregate_id: String,
    /// The event's type.
    pub event_type: String,
    /// Publish attempts the broker refused.
    pub attempts: i32,
    /// The error of its last refused attempt.
    pub last_error: Option<String>,
    /// When it was written to the outbox (the emitting transaction's `now()`).
    pub created_at: DateTime<Utc>,
    /// When the relay parked it.
    pub parked_at: DateTime<Utc>,
    /// The event's payload.
    pub payload: serde_json::Value,
}

/// A dead inbox row: its handler failed for good or too often; processors skip it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct DeadInboxEvent {
    /// The event's id (its message's `event_id` header).
    pub event_id: Uuid,
    /// The topic its handlers are routed by: the one the message was first read from.
    pub topic: String,
    /// Its message's `event_type` header (empty if there was none).
    pub event_type: String,
    /// Its message's key, as text; `None` if it had none.
    pub partition_key: Option<String>,
    /// Handling attempts that failed.
    pub attempts: i32,
    /// The error of its last failed attempt.
    pub last_error: Option<String>,
    /// When the consumer stored it in the inbox.
    pub received_at: DateTime<Utc>,
    /// When it was declared dead.
    pub dead_at: DateTime<Utc>,
    /// The event's payload.
    pub payload: serde_json::Value,
}

/// A payload as a listing shows it: its size, and the start of a small one, read without
/// reading a large one (a page of a list costs the same whatever its rows' payloads weigh).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PayloadSummary {
    /// Its size as JSON text, in bytes (what the relay sends); `None` for a payload larger
    /// than [`PAYLOAD_SUMMARY_MAX_STORED`] in storage, whose text a listing does not make.
    pub json_bytes: Option<i64>,
    /// What PostgreSQL stores for it, in bytes (`pg_column_size`), read without reading it:
    /// about its size as JSON, or less when it is stored compressed.
    pub stored_bytes: i64,
    /// Whether PostgreSQL stores it compressed (then it is larger than `stored_bytes`).
    pub compressed: bool,
    /// Its first [`PAYLOAD_PREVIEW_CHARS`] characters as JSON text; `None` for a payload
    /// larger than [`PAYLOAD_SUMMARY_MAX_STORED`] in storage.
    pub preview: Option<String>,
}

/// Payloads stored in more bytes than this are summarized by their stored size alone: their
/// text is not made (a listing reads no more than this of each row's payload; compressed, a
/// payload can expand to some times more).
pub const PAYLOAD_SUMMARY_MAX_STORED: i64 = 8192;

/// How much of a small payload a [`PayloadSummary`] shows.
pub const PAYLOAD_PREVIEW_CHARS: i64 = 200;

/// A parked outbox row as a listing shows it: [`ParkedEvent`] with its payload summarized.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct ParkedEventSummary {
    /// The outbox row's id (`outbox_event.id`).
    pub id: i64,
    /// The event's id.
    pub event_id: Uuid,
    /// The topic it is to be published to.
    pub topic: String,
    /// Its record key.
    pub partition_key: String,
    /// The aggregate's type.
    pub aggregate_type: String,
    /// The aggregate's id, as text.
    pub aggregate_id: String,
    /// The event's type.
    pub event_type: String,
    /// Publish attempts the broker refused.
    pub attempts: i32,
    /// The error of its last refused attempt.
    pub last_error: Option<String>,
    /// When it was written to the outbox.
    pub created_at: DateTime<Utc>,
    /// When the relay parked it.
    pub parked_at: DateTime<Utc>,
    /// Its payload's size, and the start of a small one.
    pub payload: PayloadSummary,
}

/// A dead inbox row as a listing shows it: [`DeadInboxEvent`] with its payload summarized.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct DeadInboxEventSummary {
    /// The event's id.
    pub event_id: Uuid,
    /// The topic its handlers are routed by.
    pub topic: String,
    /// Its message's `event_type` header (empty if there was none).
    pub event_type: String,
    /// Its message's key, as text; `None` if it had none.
    pub partition_key: Option<String>,
    /// Handling attempts that failed.
    pub attempts: i32,
    /// The error of its last failed attempt.
    pub last_error: Option<String>,
    /// When the consumer stored it in the inbox.
    pub received_at: DateTime<Utc>,
    /// When it was declared dead.
    pub dead_at: DateTime<Utc>,
    /// Its payload's size, and the start of a small one.
    pub payload: PayloadSummary,
}

/// The columns of a [`PayloadSummary`] of `payload`, in a query over a page of rows (the
/// page chosen first, in a subquery: so that no row outside it has its payload read).
fn payload_summary_columns() -> String {
    format!(
        "pg_column_size(payload)::int8 AS stored_bytes, \
         pg_column_compression(payload) IS NOT NULL AS compressed, \
         CASE WHEN pg_column_size(payload) <= {max} \
              THEN octet_length(payload::text)::int8 END AS json_bytes, \
         CASE WHEN pg_column_size(payload) <= {max} \
              THEN left(payload::text, {PAYLOAD_PREVIEW_CHARS}) END AS preview",
        max = PAYLOAD_SUMMARY_MAX_STORED
    )
}

fn payload_summary(r: &sqlx::postgres::PgRow) -> Result<PayloadSummary> {
    Ok(PayloadSummary {
        json_bytes: r.try_get("json_bytes")?,
        stored_bytes: r.try_get("stored_bytes")?,
        compressed: r.try_get("compressed")?,
        preview: r.try_get("preview")?,
    })
}

/// [`list_parked`] with each payload summarized ([`PayloadSummary`]): a page of rows whose
/// payloads weigh megabytes costs what a page of small ones does.
pub async fn list_parked_summaries(
    pool: &PgPool,
    filter: &PoisonFilter,
) -> Result<Vec<ParkedEventSummary>> {
    let sql = format!(
        "SELECT id, event_id, topic, partition_key, aggregate_type, aggregate_id, event_type, \
                attempts, last_error, created_at, parked_at, {} \
         FROM (SELECT * FROM outbox_event WHERE {}) AS page ORDER BY id",
        payload_summary_columns(),
        outbox_where!()
    );
    let rows = filter.bind(sqlx::query(&sql)).fetch_all(pool).await?;
    rows.iter()
        .map(|r| {
            Ok(ParkedEventSummary {
                id: r.try_get("id")?,
                event_id: r.try_get("event_id")?,
                topic: r.try_get("topic")?,
                partition_key: r.try_get("partition_key")?,
                aggregate_type: r.try_get("aggregate_type")?,
                aggregate_id: r.try_get("aggregate_id")?,
                event_type: r.try_get("event_type")?,
                attempts: r.try_get("attempts")?,
                last_error: r.try_get("last_error")?,
                created_at: r.try_get("created_at")?,
                parked_at: r.try_get("parked_at")?,
                payload: payload_summary(r)?,
            })
        })
        .collect()
}

/// [`list_dead`] with each payload summarized ([`PayloadSummary`]).
pub async fn list_dead_summaries(
    pool: &PgPool,
    filter: &PoisonFilter,
) -> Result<Vec<DeadInboxEventSummary>> {
    let sql = format!(
        "SELECT event_id, topic, event_type, partition_key, attempts, last_error, received_at, \
                dead_at, {} \
         FROM (SELECT * FROM inbox_event WHERE {}) AS page ORDER BY received_at, event_id",
        payload_summary_columns(),
        inbox_where!()
    );
    let rows = filter.bind(sqlx::query(&sql)).fetch_all(pool).await?;
    rows.iter()
        .map(|r| {
            Ok(DeadInboxEventSummary {
                event_id: r.try_get("event_id")?,
                topic: r.try_get("topic")?,
                event_type: r.try_get("event_type")?,
                partition_key: r.try_get("partition_key")?,
                attempts: r.try_get("attempts")?,
                last_error: r.try_get("last_error")?,
                received_at: r.try_get("received_at")?,
                dead_at: r.try_get("dead_at")?,
                payload: payload_summary(r)?,
            })
        })
        .collect()
}

/// The parked outbox rows the filter selects, oldest first.
pub async fn list_parked(pool: &PgPool, filter: &PoisonFilter) -> Result<Vec<ParkedEvent>> {
    // The rows themselves, not their ids looked up again: the lookup by id would probe every
    // partition of a partitioned outbox.
    let sql = concat!(
        "SELECT id, event_id, topic, partition_key, aggregate_type, aggregate_id, event_type, \
                attempts, last_error, created_at, parked_at, payload \
         FROM outbox_event WHERE ",
        outbox_where!()
    );
    let rows = filter.bind(sqlx::query(sql)).fetch_all(pool).await?;
    rows.into_iter()
        .map(|r| {
            Ok(ParkedEvent {
                id: r.try_get("id")?,
                event_id: r.try_get("event_id")?,
                topic: r.try_get("topic")?,
                partition_key: r.try_get("partition_key")?,
                aggregate_type: r.try_get("aggregate_type")?,
                aggregate_id: r.try_get("aggregate_id")?,
                event_type: r.try_get("event_type")?,
                attempts: r.try_get("attempts")?,
                last_error: r.try_get("last_error")?,
                created_at: r.try_get("created_at")?,
                parked_at: r.try_get("parked_at")?,
                payload: r.try_get("payload")?,
            })
        })
        .collect()
}

/// How many parked outbox rows the filter selects, counting at most its limit (a count capped
/// so that a listing can say "1,000+" without counting a million rows).
pub async fn count_parked(pool: &PgPool, filter: &PoisonFilter) -> Result<i64> {
    let sql = format!("SELECT count(*) FROM ({OUTBOX_SELECT}) AS selected");
    Ok(filter
        .bind(sqlx::query(&sql))
        .fetch_one(pool)
        .await?
        .try_get(0)?)
}

/// How many dead inbox rows the filter selects, counting at most its limit.
pub async fn count_dead(pool: &PgPool, filter: &PoisonFilter) -> Result<i64> {
    let sql = format!("SELECT count(*) FROM ({INBOX_SELECT}) AS selected");
    Ok(filter
        .bind(sqlx::query(&sql))
        .fetch_one(pool)
        .await?
        .try_get(0)?)
}

/// Un-parks the rows the filter selects: the relay publishes them again from a clean slate
/// (attempts reset), and is woken at once. They are due for a retry now, which is how running
/// relays, whose claims have moved past them, find them again. Their keys' later events were published meanwhile
/// (a parked row does not hold its key), so a retried event reaches consumers after them.
/// Each row keeps its last error, and records when it was retried and by what
/// (`outbox_runtime::admin::retry_parked`; [`retry_parked_by`] names the action).
/// Returns how many rows it un-parked.
pub async fn retry_parked(pool: &PgPool, filter: &PoisonFilter) -> Result<u64> {
    retry_parked_by(pool, filter, "outbox_runtime::admin::retry_parked").await
}

/// [`retry_parked`], recording `action` as what retried the rows (`retried_by`: the console
/// records "Retry in the console", the CLI "outbox parked retry"), which the console's event
/// page shows beside the time.
pub async fn retry_parked_by(pool: &PgPool, filter: &PoisonFilter, action: &str) -> Result<u64> {
    let sql = format!(
        "UPDATE outbox_event SET parked_at = NULL, attempts = 0, next_attempt_at = now(), \
                retried_at = now(), retried_by = $11 \
         WHERE parked_at IS NOT NULL AND id IN ({OUTBOX_SELECT})"
    );
    let mut tx = pool.begin().await?;
    let retried = filter
        .bind(sqlx::query(&sql))
        .bind(action)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    if retried > 0 {
        sqlx::query("SELECT pg_notify('outbox_event', '')")
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(retried)
}

/// Deletes the parked rows the filter selects, for good. Returns how many it deleted.
pub async fn drop_parked(pool: &PgPool, filter: &PoisonFilter) -> Result<u64> {
    let sql = format!(
        "DELETE FROM outbox_event \
         WHERE parked_at IS NOT NULL AND published_at IS NULL AND id IN ({OUTBOX_SELECT})"
    );
    let done = filter.bind(sqlx::query(&sql)).execute(pool).await?;
    Ok(done.rows_affected())
}

/// The dead inbox rows the filter selects, oldest first (outbox `id`s in the filter match
/// nothing here).
pub async fn list_dead(pool: &PgPool, filter: &PoisonFilter) -> Result<Vec<DeadInboxEvent>> {
    let sql = concat!(
        "SELECT event_id, topic, event_type, partition_key, attempts, last_error, received_at, \
                dead_at, payload \
         FROM inbox_event WHERE ",
        inbox_where!()
    );
    let rows = filter.bind(sqlx::query(sql)).fetch_all(pool).await?;
    rows.into_iter()
        .map(|r| {
            Ok(DeadInboxEvent {
                event_id: r.try_get("event_id")?,
                topic: r.try_get("topic")?,
                event_type: r.try_get("event_type")?,
                partition_key: r.try_get("partition_key")?,
                attempts: r.try_get("attempts")?,
                last_error: r.try_get("last_error")?,
                received_at: r.try_get("received_at")?,
                dead_at: r.try_get("dead_at")?,
                payload: r.try_get("payload")?,
            })
        })
        .collect()
}

/// Revives the dead inbox rows the filter selects: the inbox processors handle them again,
/// attempts reset. Each row keeps its last error, and records when it was retried and by what
/// ([`retry_dead_by`] names the action). Returns how many rows it revived.
pub async fn retry_dead(pool: &PgPool, filter: &PoisonFilter) -> Result<u64> {
    retry_dead_by(pool, filter, "outbox_runtime::admin::retry_dead").await
}

/// [`retry_dead`], recording `action` as what retried the rows (`retried_by`).
pub async fn retry_dead_by(pool: &PgPool, filter: &PoisonFilter, action: &str) -> Result<u64> {
    let sql = format!(
        "UPDATE inbox_event SET dead_at = NULL, attempts = 0, next_attempt_at = NULL, \
                retried_at = now(), retried_by = $11 \
         WHERE dead_at IS NOT NULL AND event_id IN ({INBOX_SELECT})"
    );
    let done = filter
        .bind(sqlx::query(&sql))
        .bind(action)
        .execute(pool)
        .await?;
    Ok(done.rows_affected())
}

/// Settles the dead inbox rows the filter selects without handling them: each becomes a
/// processed row (its `last_error` prefixed with `discarded: `), so it stays a dedup record (a
/// redelivery of the event is not handled either), is no longer dead, and goes with its
/// partition or by retention. Returns how many rows it discarded.
pub async fn discard_dead(pool: &PgPool, filter: &PoisonFilter) -> Result<u64> {
    let sql = format!(
        "UPDATE inbox_event SET processed = true, processed_at = now(), dead_at = NULL, \
             next_attempt_at = NULL, last_error = 'discarded: ' || coalesce(last_error, '') \
         WHERE dead_at IS NOT NULL AND event_id IN ({INBOX_SELECT})"
    );
    let done = filter.bind(sqlx::query(&sql)).execute(pool).await?;
    Ok(done.rows_affected())
}
