//! Where things are: the live relay instances and their shards, the keys held back by an
//! operator's problem, and where one event is now (its outbox row, inbox row, dedup records).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::error::Result;

/// A live relay instance of this database's outbox, as PostgreSQL sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RelayInstance {
    /// The backend process id of its connection (`pg_stat_activity.pid`).
    pub pid: i32,
    /// Its member slot (one per live instance).
    pub slot: i32,
    /// The shards it publishes (`hashtext(partition_key) & 63`), in order.
    pub shards: Vec<i32>,
    /// When its connection started: it has held its member slot since then.
    pub connected_at: Option<DateTime<Utc>>,
    /// Its connection's `application_name`.
    pub application_name: Option<String>,
    /// Its connection's client address (`None` over a Unix socket, or when this role may not
    /// see other roles' sessions).
    pub client_addr: Option<String>,
}

/// A partition key whose rows wait for an operator: the relay was refused for a reason that
/// only an operator fixes (a missing topic, missing authorization).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct HeldKey {
    /// The topic its rows go to.
    pub topic: String,
    /// The partition key.
    pub partition_key: String,
    /// Its unpublished rows (all wait, in order).
    pub rows: i64,
    /// Since when its first row has been held.
    pub held_since: DateTime<Utc>,
    /// The broker's error for its first row.
    pub last_error: Option<String>,
}

/// The live relay instances of the outbox on the `search_path`, by member slot.
pub async fn relay_instances(pool: &PgPool) -> Result<Vec<RelayInstance>> {
    let members = crate::store::relay::member_list(&mut *pool.acquire().await?).await?;
    Ok(members
        .into_iter()
        .map(|m| RelayInstance {
            pid: m.pid,
            slot: m.slot,
            shards: m.shards,
            connected_at: m.connected_at,
            application_name: m.application_name,
            client_addr: m.client_addr,
        })
        .collect())
}

/// The held keys, those held longest first, at most `limit`. A held row always waits for its
/// next attempt, so this reads the retrying rows' index, not a backlog of unpublished rows.
pub async fn held_keys(pool: &PgPool, limit: u32) -> Result<Vec<HeldKey>> {
    let rows = sqlx::query(
        "SELECT topic, partition_key, count(*) AS rows, min(held_at) AS held_since, \
                (array_agg(last_error ORDER BY id))[1] AS last_error \
         FROM outbox_event \
         WHERE published_at IS NULL AND parked_at IS NULL AND held_at IS NOT NULL \
           AND next_attempt_at IS NOT NULL \
         GROUP BY topic, partition_key \
         ORDER BY held_since, topic, partition_key LIMIT $1",
    )
    .bind(i64::from(limit))
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(HeldKey {
                topic: r.try_get("topic")?,
                partition_key: r.try_get("partition_key")?,
                rows: r.try_get("rows")?,
                held_since: r.try_get("held_since")?,
                last_error: r.try_get("last_error")?,
            })
        })
        .collect()
}

/// An outbox row, as [`find_event`] shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct OutboxRow {
    /// `outbox_event.id`.
    pub id: i64,
    /// The event's id.
    pub event_id: Uuid,
    /// Its topic.
    pub topic: String,
    /// Its partition key.
    pub partition_key: String,
    /// The aggregate's type.
    pub aggregate_type: String,
    /// The aggregate's id.
    pub aggregate_id: String,
    /// The event's type.
    pub event_type: String,
    /// When its transaction wrote it.
    pub created_at: DateTime<Utc>,
    /// When a relay published it (`None`: not yet).
    pub published_at: Option<DateTime<Utc>>,
    /// Publish attempts the broker refused.
    pub attempts: i32,
    /// The broker's last refusal.
    pub last_error: Option<String>,
    /// When it is due for its next attempt (`None`: not retrying).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// Since when it has been held for an operator's problem.
    pub held_at: Option<DateTime<Utc>>,
    /// When it was parked (`None`: not parked).
    pub parked_at: Option<DateTime<Utc>>,
    /// When an operator last retried it (parked), if one did.
    pub retried_at: Option<DateTime<Utc>>,
    /// What retried it (the console's Retry, `outbox parked retry`...).
    pub retried_by: Option<String>,
    /// The application's headers stored with it.
    pub headers: serde_json::Value,
    /// Its payload.
    pub payload: serde_json::Value,
    /// Its payload's size as JSON text, in bytes (what the relay sends).
    pub payload_bytes: i64,
}

/// An inbox row, as [`find_event`] shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct InboxRow {
    /// The topic it was first read from.
    pub topic: String,
    /// Its message's `event_type` header.
    pub event_type: String,
    /// Its message's key.
    pub partition_key: Option<String>,
    /// The partition and offset it was read from.
    pub source: Option<(i32, i64)>,
    /// When the consumer stored it.
    pub received_at: DateTime<Utc>,
    /// Whether its handlers ran (or it was discarded).
    pub processed: bool,
    /// When.
    pub processed_at: Option<DateTime<Utc>>,
    /// Handling attempts that failed.
    pub attempts: i32,
    /// The last failure's error.
    pub last_error: Option<String>,
    /// When it was declared dead (`None`: not dead).
    pub dead_at: Option<DateTime<Utc>>,
    /// When an operator last retried it (dead), if one did.
    pub retried_at: Option<DateTime<Utc>>,
    /// What retried it (the console's Retry, `outbox inbox dead retry`...).
    pub retried_by: Option<String>,
    /// Its message's headers.
    pub headers: serde_json::Value,
    /// Its payload.
    pub payload: serde_json::Value,
    /// Its payload's size as JSON text, in bytes.
    pub payload_bytes: i64,
}

/// A dedup record: a handler that handled the event in dedup mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DedupRow {
    /// The handler's name.
    pub handler: String,
    /// When its transaction committed.
    pub processed_at: DateTime<Utc>,
}

/// Where an event is now, in this database: [`find_event`]'s answer. Every part is empty when
/// the event never passed through this database, or retention has removed its rows.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct EventTrace {
    /// The event id looked up.
    pub event_id: Uuid,
    /// Its outbox row, if this database emitted it.
    pub outbox: Option<OutboxRow>,
    /// Its inbox row, if an inbox-mode consumer of this database received it.
    pub inbox: Option<InboxRow>,
    /// The dedup-mode handlers that handled it.
    pub processed: Vec<DedupRow>,
}

impl EventTrace {
    /// Whether the database holds nothing about the event.
    pub fn is_empty(&self) -> bool {
        self.outbox.is_none() && self.inbox.is_none() && self.processed.is_empty()
    }
}

/// Which event to find: its event id, or its outbox row's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventRef {
    /// An event id (a UUID): outbox, inbox and dedup records.
    EventId(Uuid),
    /// `outbox_event.id`: the row, then the event's inbox and dedup records.
    OutboxId(i64),
}

impl std::str::FromStr for EventRef {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        if let Ok(id) = s.parse::<i64>() {
            return Ok(EventRef::OutboxId(id));
        }
        Uuid::parse_str(s).map(EventRef::EventId).map_err(|_| {
            format!("`{s}` is neither an event id (a UUID) nor an outbox row id (a number)")
        })
    }
}

const OUTBOX_COLUMNS: &str = "id, event_id, topic, partition_key, aggregate_type, aggregate_id, \
     event_type, created_at, published_at, attempts, last_error, next_attempt_at, held_at, \
     parked_at, retried_at, retried_by, headers, payload, \
     octet_length(payload::text)::int8 AS payload_bytes";

/// Where an event is now: its outbox row, its inbox row and its dedup records. `None` for an
/// outbox row id that no row has.
pub async fn find_event(pool: &PgPool, which: EventRef) -> Result<Option<EventTrace>> {
    let mut conn = pool.acquire().await?;
    let row = match which {
        EventRef::EventId(event_id) => {
            sqlx::query(&format!(
                "SELECT {OUTBOX_COLUMNS} FROM outbox_event WHERE event_id = $1"
            ))
            .bind(event_id)
            .fetch_optional(&mut *conn)
            .await?
        }
        EventRef::OutboxId(id) => {
            sqlx::query(&format!(
                "SELECT {OUTBOX_COLUMNS} FROM outbox_event WHERE id = $1"
            ))
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?
        }
    };
    let outbox = row
        .map(|r| {
            Ok::<_, crate::Error>(OutboxRow {
                id: r.try_get("id")?,
                event_id: r.try_get("event_id")?,
                topic: r.try_get("topic")?,
                partition_key: r.try_get("partition_key")?,
                aggregate_type: r.try_get("aggregate_type")?,
                aggregate_id: r.try_get("aggregate_id")?,
                event_type: r.try_get("event_type")?,
                created_at: r.try_get("created_at")?,
                published_at: r.try_get("published_at")?,
                attempts: r.try_get("attempts")?,
                last_error: r.try_get("last_error")?,
                next_attempt_at: r.try_get("next_attempt_at")?,
                held_at: r.try_get("held_at")?,
                parked_at: r.try_get("parked_at")?,
                retried_at: r.try_get("retried_at")?,
                retried_by: r.try_get("retried_by")?,
                headers: r.try_get("headers")?,
                payload: r.try_get("payload")?,
                payload_bytes: r.try_get("payload_bytes")?,
            })
        })
        .transpose()?;
    let event_id = match (which, &outbox) {
        (EventRef::EventId(id), _) => id,
        (EventRef::OutboxId(_), Some(row)) => row.event_id,
        (EventRef::OutboxId(_), None) => return Ok(None),
    };
    let inbox = sqlx::query(
        "SELECT topic, event_type, partition_key, source_partition, source_offset, received_at, \
                processed, processed_at, attempts, last_error, dead_at, retried_at, retried_by, \
                headers, payload, \
                octet_length(payload::text)::int8 AS payload_bytes \
         FROM inbox_event WHERE event_id = $1",
    )
    .bind(event_id)
    .fetch_optional(&mut *conn)
    .await?
    .map(|r| {
        let partition: Option<i32> = r.try_get("source_partition")?;
        let offset: Option<i64> = r.try_get("source_offset")?;
        Ok::<_, crate::Error>(InboxRow {
            topic: r.try_get("topic")?,
            event_type: r.try_get("event_type")?,
            partition_key: r.try_get("partition_key")?,
            source: partition.zip(offset),
            received_at: r.try_get("received_at")?,
            processed: r.try_get("processed")?,
            processed_at: r.try_get("processed_at")?,
            attempts: r.try_get("attempts")?,
            last_error: r.try_get("last_error")?,
            dead_at: r.try_get("dead_at")?,
            retried_at: r.try_get("retried_at")?,
            retried_by: r.try_get("retried_by")?,
            headers: r.try_get("headers")?,
            payload: r.try_get("payload")?,
            payload_bytes: r.try_get("payload_bytes")?,
        })
    })
    .transpose()?;
    let processed = sqlx::query(
        "SELECT handler, processed_at FROM processed_event WHERE event_id = $1 ORDER BY handler",
    )
    .bind(event_id)
    .fetch_all(&mut *conn)
    .await?
    .iter()
    .map(|r| {
        Ok(DedupRow {
            handler: r.try_get("handler")?,
            processed_at: r.try_get("processed_at")?,
        })
    })
    .collect::<Result<_>>()?;
    Ok(Some(EventTrace {
        event_id,
        outbox,
        inbox,
        processed,
    }))
}

/// Whose payload [`payload_text`] reads: the event's outbox row or its inbox row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadOf {
    /// Its outbox row (found by event id or outbox row id).
    Outbox,
    /// Its inbox row (found by event id).
    Inbox,
}

/// An event's payload as JSON text, exactly as the relay sends it (`payload::text`), for a
/// payload too large to show inline; `None` when there is no such row.
pub async fn payload_text(pool: &PgPool, which: EventRef, of: PayloadOf) -> Result<Option<String>> {
    let query = match (of, which) {
        (PayloadOf::Outbox, EventRef::EventId(id)) => sqlx::query_scalar::<_, String>(
            "SELECT payload::text FROM outbox_event WHERE event_id = $1",
        )
        .bind(id),
        (PayloadOf::Outbox, EventRef::OutboxId(id)) => {
            sqlx::query_scalar::<_, String>("SELECT payload::text FROM outbox_event WHERE id = $1")
                .bind(id)
        }
        (PayloadOf::Inbox, EventRef::EventId(id)) => sqlx::query_scalar::<_, String>(
            "SELECT payload::text FROM inbox_event WHERE event_id = $1",
        )
        .bind(id),
        (PayloadOf::Inbox, EventRef::OutboxId(_)) => return Ok(None),
    };
    Ok(query.fetch_optional(pool).await?)
}
