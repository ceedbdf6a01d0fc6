//! Parked outbox rows on MariaDB/MySQL, listed, retried or dropped: [`list_parked`] and the rest
//! of `admin`'s poison tools, on a `MySqlPool`, with the same [`PoisonFilter`] and the same
//! meaning (re-exported as `outbox_runtime::mysql::{list_parked, ...}`).
//!
//! A filter is one statement's `WHERE ... ORDER BY id LIMIT n`: a retry or drop changes in one
//! statement exactly the rows a listing with the same filter shows, the oldest first, and rows
//! a concurrent statement changed meanwhile are tested again against it when their lock frees.
//! Every statement runs at READ COMMITTED: under REPEATABLE READ its scan of the parked rows
//! would gap-lock the index's next range, where emitters insert new unpublished rows.

use chrono::{DateTime, NaiveDateTime};
use sqlx::mysql::MySqlRow;
use sqlx::{MySql, MySqlPool, QueryBuilder, Row};
use uuid::Uuid;

use super::poison::{ParkedEvent, PoisonFilter};
use crate::error::{Error, Result};

/// The columns a [`ParkedEvent`] is read from, text cast to the connection's character set.
const PARKED_COLUMNS: &str = "id, event_id, CAST(topic AS CHAR), CAST(partition_key AS CHAR), \
    CAST(aggregate_type AS CHAR), CAST(aggregate_id AS CHAR), CAST(event_type AS CHAR), \
    attempts, CAST(last_error AS CHAR), created_at, parked_at, CAST(payload AS CHAR)";

/// Appends the filter's conditions, its order and its limit. Parked rows are unpublished, so
/// the scan is the range of `ix_outbox_event_claim` (`published_at, parked_at, ...`) that holds
/// them, not the table.
fn push_filter(sql: &mut QueryBuilder<'_, MySql>, filter: &PoisonFilter) {
    sql.push(" WHERE published_at IS NULL AND parked_at IS NOT NULL");
    if let Some(topic) = &filter.topic {
        sql.push(" AND topic = ").push_bind(topic.clone());
    }
    if let Some(event_type) = &filter.event_type {
        sql.push(" AND event_type = ").push_bind(event_type.clone());
    }
    // The ids as literals (integers, and hexadecimal for the event ids: nothing to escape), not
    // placeholders: a prepared statement takes at most 65,535, and the CLI names every row it
    // listed.
    if !filter.ids.is_empty() || !filter.event_ids.is_empty() {
        sql.push(" AND (FALSE");
        if !filter.ids.is_empty() {
            let ids: Vec<String> = filter.ids.iter().map(i64::to_string).collect();
            sql.push(format_args!(" OR id IN ({})", ids.join(", ")));
        }
        if !filter.event_ids.is_empty() {
            let ids: Vec<String> = filter
                .event_ids
                .iter()
                .map(|id| format!("X'{}'", id.simple()))
                .collect();
            sql.push(format_args!(" OR event_id IN ({})", ids.join(", ")));
        }
        sql.push(")");
    }
    if let Some(since) = filter.since {
        sql.push(" AND created_at >= ").push_bind(since.naive_utc());
    }
    if let Some(until) = filter.until {
        sql.push(" AND created_at < ").push_bind(until.naive_utc());
    }
    if let Some(after) = filter.after_id {
        sql.push(" AND id > ").push_bind(after);
    }
    sql.push(" ORDER BY id");
    if let Some(limit) = filter.limit {
        sql.push(" LIMIT ").push_bind(limit);
    }
}

/// The parked outbox rows the filter selects, oldest first (what `outbox parked list` shows for
/// a `mysql://` URL). Inbox-only parts of a filter ([`PoisonFilter::after_received`]) select
/// nothing more or less here.
pub async fn list_parked(pool: &MySqlPool, filter: &PoisonFilter) -> Result<Vec<ParkedEvent>> {
    let mut sql = QueryBuilder::new(format!("SELECT {PARKED_COLUMNS} FROM outbox_event"));
    push_filter(&mut sql, filter);
    let rows = sql.build().fetch_all(pool).await?;
    rows.iter().map(parked_event).collect()
}

/// How many parked outbox rows the filter selects, counting at most its limit.
pub async fn count_parked(pool: &MySqlPool, filter: &PoisonFilter) -> Result<i64> {
    let mut sql = QueryBuilder::new("SELECT COUNT(*) FROM (SELECT id FROM outbox_event");
    push_filter(&mut sql, filter);
    sql.push(") AS selected");
    Ok(sql.build().fetch_one(pool).await?.try_get(0)?)
}

/// Un-parks the rows the filter selects: the relays publish them again from a clean slate
/// (attempts reset). A relay on these databases keeps no cursor, so its next claim finds them;
/// one in another process (the CLI's case) within its poll interval. Their keys' later events
/// were published meanwhile (a parked row does not hold its key), so a retried event reaches
/// consumers after them. Each row keeps its last error, and records when it was retried and by
/// what (`outbox_runtime::mysql::retry_parked`; [`retry_parked_by`] names the action). Returns
/// how many rows it un-parked.
pub async fn retry_parked(pool: &MySqlPool, filter: &PoisonFilter) -> Result<u64> {
    retry_parked_by(pool, filter, "outbox_runtime::mysql::retry_parked").await
}

/// [`retry_parked`], recording `action` as what retried the rows (`retried_by`, at most 255
/// characters: the CLI records "outbox parked retry").
pub async fn retry_parked_by(pool: &MySqlPool, filter: &PoisonFilter, action: &str) -> Result<u64> {
    if action.chars().count() > 255 {
        return Err(Error::Config(format!(
            "the retry's action is {} characters; `retried_by` holds 255",
            action.chars().count()
        )));
    }
    let mut sql = QueryBuilder::new(
        "UPDATE outbox_event SET parked_at = NULL, attempts = 0, next_attempt_at = NULL, \
         retried_at = UTC_TIMESTAMP(6), retried_by = ",
    );
    sql.push_bind(action);
    push_filter(&mut sql, filter);
    read_committed(pool, sql).await
}

/// Deletes the parked rows the filter selects, for good. Returns how many it deleted.
pub async fn drop_parked(pool: &MySqlPool, filter: &PoisonFilter) -> Result<u64> {
    let mut sql = QueryBuilder::new("DELETE FROM outbox_event");
    push_filter(&mut sql, filter);
    read_committed(pool, sql).await
}

/// Runs a write in a transaction of its own at READ COMMITTED. Returns the rows it changed.
async fn read_committed(pool: &MySqlPool, mut sql: QueryBuilder<'_, MySql>) -> Result<u64> {
    let mut tx = pool
        .begin_with("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
        .await?;
    let changed = sql.build().execute(&mut *tx).await?.rows_affected();
    tx.commit().await?;
    Ok(changed)
}

/// A row of [`PARKED_COLUMNS`].
fn parked_event(r: &MySqlRow) -> Result<ParkedEvent> {
    let decode =
        |e: Box<dyn std::error::Error + Send + Sync>| Error::Database(sqlx::Error::Decode(e));
    let event_id: Vec<u8> = r.try_get(1)?;
    let payload: String = r.try_get(11)?;
    Ok(ParkedEvent {
        id: r.try_get(0)?,
        event_id: Uuid::from_slice(&event_id).map_err(|e| decode(Box::new(e)))?,
        topic: r.try_get(2)?,
        partition_key: r.try_get(3)?,
        aggregate_type: r.try_get(4)?,
        aggregate_id: r.try_get(5)?,
        event_type: r.try_get(6)?,
        attempts: r.try_get(7)?,
        last_error: r.try_get(8)?,
        created_at: utc(r.try_get(9)?),
        parked_at: utc(r.try_get(10)?),
        payload: serde_json::from_str(&payload).map_err(|e| decode(Box::new(e)))?,
    })
}

/// A `DATETIME(6)` of these tables (UTC, written with `UTC_TIMESTAMP(6)`).
fn utc(at: NaiveDateTime) -> DateTime<chrono::Utc> {
    at.and_utc()
}
