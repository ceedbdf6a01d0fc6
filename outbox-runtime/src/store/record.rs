//! [`Claimed`]: an outbox row as the relay claims it and a replay reads it, and the columns it is
//! read from.

use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::error::Result;

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
    /// The application's headers as a JSON object, `None` when it has none.
    pub headers: Option<String>,
    /// The record's timestamp when it is not `created_at_ms`: a replay's, when it was
    /// replayed (CloudEvents' `time` stays `created_at_ms`).
    pub replayed_at_ms: Option<i64>,
}

/// The columns a [`Claimed`] is read from (table alias `o`), in the order `from_row` reads
/// them.
macro_rules! claimed_columns {
    () => {
        "o.id, o.event_id, o.topic, o.partition_key, o.aggregate_type, o.aggregate_id, \
         o.event_type, o.payload::text AS payload, o.attempts, \
         (extract(epoch FROM o.created_at) * 1000)::int8 AS created_at_ms, \
         NULLIF(o.headers, '{}'::jsonb)::text AS headers"
    };
}
#[allow(unused_imports)] // used by the relay and replay, built with a broker
pub(crate) use claimed_columns;

impl Claimed {
    /// Reads a row whose first columns are [`claimed_columns!`], from column `first` on.
    pub(crate) fn from_row(r: &PgRow, first: usize) -> Result<Claimed> {
        Ok(Claimed {
            id: r.try_get(first)?,
            event_id: r.try_get(first + 1)?,
            topic: r.try_get(first + 2)?,
            partition_key: r.try_get(first + 3)?,
            aggregate_type: r.try_get(first + 4)?,
            aggregate_id: r.try_get(first + 5)?,
            event_type: r.try_get(first + 6)?,
            payload: r.try_get(first + 7)?,
            attempts: r.try_get(first + 8)?,
            created_at_ms: r.try_get(first + 9)?,
            headers: r.try_get(first + 10)?,
            replayed_at_ms: None,
        })
    }
}

/// The columns a [`Claimed`] is read from on MariaDB/MySQL (alias `o`), in the order
/// [`Claimed::from_mysql_row`] reads them, text cast to the connection's character set (sqlx
/// reads the `_bin` columns, and MariaDB's JSON, as bytes otherwise).
#[cfg(feature = "mysql")]
pub(crate) const MYSQL_CLAIMED_COLUMNS: &str = "o.id, o.event_id, CAST(o.topic AS CHAR), \
    CAST(o.partition_key AS CHAR), CAST(o.aggregate_type AS CHAR), \
    CAST(o.aggregate_id AS CHAR), CAST(o.event_type AS CHAR), CAST(o.payload AS CHAR), \
    o.attempts, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.created_at) DIV 1000, \
    CAST(o.headers AS CHAR)";

#[cfg(feature = "mysql")]
impl Claimed {
    /// Reads a row whose first columns are [`MYSQL_CLAIMED_COLUMNS`].
    pub(crate) fn from_mysql_row(r: &sqlx::mysql::MySqlRow) -> Result<Claimed> {
        let event_id: Vec<u8> = r.try_get(1)?;
        let event_id = uuid::Uuid::from_slice(&event_id)
            .map_err(|e| crate::error::Error::Database(sqlx::Error::Decode(Box::new(e))))?;
        Ok(Claimed {
            id: r.try_get(0)?,
            event_id,
            topic: r.try_get(2)?,
            partition_key: r.try_get(3)?,
            aggregate_type: r.try_get(4)?,
            aggregate_id: r.try_get(5)?,
            event_type: r.try_get(6)?,
            payload: r.try_get(7)?,
            attempts: r.try_get(8)?,
            created_at_ms: r.try_get(9)?,
            headers: r.try_get(10)?,
            replayed_at_ms: None,
        })
    }
}
