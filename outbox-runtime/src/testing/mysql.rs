//! The test kit's reads of the outbox on MariaDB/MySQL (features `testing` and `mysql`):
//! [`emitted`] and [`emitted_records`], as [`super::emitted`] and [`super::emitted_records`]
//! read PostgreSQL's. [`deliver`](super::deliver) and
//! [`MockKafka::relay_pending`](super::MockKafka::relay_pending) take a `MySqlPool` as they
//! take a `PgPool`.
//!
//! ```no_run
//! # use outbox_runtime::OutboxEvent;
//! # #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize, OutboxEvent)]
//! # #[outbox(topic = "order.events", aggregate_type = "Order")]
//! # struct OrderPlaced { #[outbox(aggregate_id)] order_id: uuid::Uuid }
//! # async fn f(pool: sqlx::MySqlPool) -> outbox_runtime::Result<()> {
//! use outbox_runtime::testing;
//!
//! let placed: Vec<OrderPlaced> = testing::mysql::emitted(&pool).await?;
//! let rows = testing::mysql::emitted_records(&pool).await?;
//! # Ok(()) }
//! ```

use serde::de::DeserializeOwned;
use sqlx::mysql::MySqlRow;
use sqlx::{MySqlExecutor, Row};
use uuid::Uuid;

use super::{first_header, EmittedRecord};
use crate::error::{Error, Result};
use crate::event::OutboxEvent;

/// The columns an [`EmittedRecord`] is read from, text cast to the connection's character set
/// (MariaDB's `JSON` is text of a binary collation).
const COLUMNS: &str = "event_id, CAST(topic AS CHAR), CAST(partition_key AS CHAR), \
    CAST(aggregate_type AS CHAR), CAST(aggregate_id AS CHAR), CAST(event_type AS CHAR), \
    CAST(payload AS CHAR), CAST(published_at IS NOT NULL AS SIGNED), CAST(headers AS CHAR)";

/// The events of type `E` in the outbox, the oldest first: committed ones, or, given the test's
/// own transaction (`&mut *tx`), the ones it emitted so far.
pub async fn emitted<'e, E>(db: impl MySqlExecutor<'e>) -> Result<Vec<E>>
where
    E: OutboxEvent + DeserializeOwned,
{
    let payloads: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(payload AS CHAR) FROM outbox_event \
         WHERE topic = ? AND event_type = ? ORDER BY id",
    )
    .bind(E::TOPIC)
    .bind(E::EVENT_TYPE)
    .fetch_all(db)
    .await?;
    payloads
        .iter()
        .map(|p| serde_json::from_str(p).map_err(decode))
        .collect()
}

/// Every row of the outbox, the oldest first (see [`emitted`] for which rows a connection sees).
pub async fn emitted_records<'e>(db: impl MySqlExecutor<'e>) -> Result<Vec<EmittedRecord>> {
    let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM outbox_event ORDER BY id"))
        .fetch_all(db)
        .await?;
    rows.iter().map(record).collect()
}

/// A row of [`COLUMNS`].
fn record(row: &MySqlRow) -> Result<EmittedRecord> {
    let event_id: Vec<u8> = row.try_get(0)?;
    let payload: String = row.try_get(6)?;
    let headers: Option<String> = row.try_get(8)?;
    let headers: Vec<(String, String)> = match headers.as_deref().map(serde_json::from_str) {
        Some(Ok(serde_json::Value::Object(map))) => map
            .into_iter()
            .filter_map(|(k, v)| match v {
                serde_json::Value::String(v) => Some((k, v)),
                _ => None,
            })
            .collect(),
        Some(Err(e)) => return Err(decode(e)),
        _ => Vec::new(),
    };
    let schema_version = first_header(&headers, crate::SCHEMA_VERSION_HEADER)
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    Ok(EmittedRecord {
        event_id: Uuid::from_slice(&event_id).map_err(decode)?,
        topic: row.try_get(1)?,
        partition_key: row.try_get(2)?,
        aggregate_type: row.try_get(3)?,
        aggregate_id: row.try_get(4)?,
        event_type: row.try_get(5)?,
        payload: serde_json::from_str(&payload).map_err(decode)?,
        published: row.try_get::<i64, _>(7)? != 0,
        headers,
        schema_version,
    })
}

/// A value the outbox holds that does not decode.
fn decode(e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::Database(sqlx::Error::Decode(Box::new(e)))
}
