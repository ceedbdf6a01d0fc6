//! Retention: deleting old published outbox rows, processed inbox rows and dedup rows.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::error::{Error, Result};

/// A table the retention job cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CleanupTable {
    /// `outbox_event`: published rows whose `published_at` is before the cut-off. Unpublished
    /// and parked rows are never deleted.
    Outbox,
    /// `inbox_event`: processed rows whose `processed_at` is before the cut-off. Unprocessed
    /// and dead rows are never deleted. These rows are inbox mode's dedup records: a message
    /// delivered again after its row is gone is handled again (as for `processed_event`).
    Inbox,
    /// `processed_event`: rows whose `processed_at` is before the cut-off. A message delivered
    /// again after its row is gone is handled again: keep these longer than any redelivery
    /// (the topic's retention, replays).
    ProcessedEvent,
}

impl CleanupTable {
    /// Every table, in the order the retention job cuts them.
    pub const ALL: [CleanupTable; 3] = [
        CleanupTable::Outbox,
        CleanupTable::Inbox,
        CleanupTable::ProcessedEvent,
    ];

    /// The table's name in the database.
    pub fn table_name(self) -> &'static str {
        match self {
            CleanupTable::Outbox => "outbox_event",
            CleanupTable::Inbox => "inbox_event",
            CleanupTable::ProcessedEvent => "processed_event",
        }
    }

    /// The rows past the cut-off `$1`.
    fn condition(self) -> &'static str {
        match self {
            CleanupTable::Outbox => "published_at < $1",
            CleanupTable::Inbox => "processed AND processed_at < $1",
            CleanupTable::ProcessedEvent => "processed_at < $1",
        }
    }

    /// The column the condition's index is on.
    fn age_column(self) -> &'static str {
        match self {
            CleanupTable::Outbox => "published_at",
            CleanupTable::Inbox | CleanupTable::ProcessedEvent => "processed_at",
        }
    }
}

impl std::str::FromStr for CleanupTable {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "outbox" | "outbox_event" => Ok(CleanupTable::Outbox),
            "inbox" | "inbox_event" => Ok(CleanupTable::Inbox),
            "processed" | "processed_event" => Ok(CleanupTable::ProcessedEvent),
            other => Err(Error::Config(format!(
                "unknown table `{other}` (expected outbox, inbox or processed)"
            ))),
        }
    }
}

/// The retention job: deletes rows older than a cut-off in small batches, each its own short
/// transaction (no long locks, no table rewrite), skipping rows another transaction holds.
/// Safe to run while relays and consumers run.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> outbox_runtime::Result<()> {
/// use std::time::Duration;
/// use outbox_runtime::admin::{Cleanup, CleanupTable};
///
/// let cleanup = Cleanup::new(pool, Duration::from_secs(30 * 86_400));
/// let cutoff = cleanup.cutoff().await?;
/// let removed = cleanup.run(CleanupTable::Outbox, cutoff, |_so_far| {}).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Cleanup {
    pool: PgPool,
    older_than: Duration,
    batch_size: i64,
}

impl Cleanup {
    /// Rows older than `older_than` (by the database's clock) go; batches of 10,000 rows.
    pub fn new(pool: PgPool, older_than: Duration) -> Self {
        Cleanup {
            pool,
            older_than,
            batch_size: 10_000,
        }
    }

    /// Rows deleted per transaction (default 10,000; at least 1).
    #[must_use]
    pub fn batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = i64::from(batch_size.max(1));
        self
    }

    /// The cut-off: now, by the database's clock, minus `older_than`. Take it once and pass it
    /// to [`count`](Self::count) and [`run`](Self::run), so that both see the same rows.
    pub async fn cutoff(&self) -> Result<DateTime<Utc>> {
        let cutoff: DateTime<Utc> =
            sqlx::query_scalar("SELECT now() - make_interval(secs => $1::float8)")
                .bind(self.older_than.as_secs_f64())
                .fetch_one(&self.pool)
                .await?;
        Ok(cutoff)
    }

    /// How many rows of `table` are past `cutoff` (what a dry run reports).
    pub async fn count(&self, table: CleanupTable, cutoff: DateTime<Utc>) -> Result<u64> {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE {}",
            table.table_name(),
            table.condition()
        );
        let n: i64 = sqlx::query_scalar(&sql)
            .bind(cutoff)
            .fetch_one(&self.pool)
            .await?;
        Ok(n.max(0) as u64)
    }

    /// Deletes the rows of `table` past `cutoff`, a batch per transaction, calling `progress`
    /// with the total so far after each batch. Returns how many rows it deleted.
    pub async fn run(
        &self,
        table: CleanupTable,
        cutoff: DateTime<Utc>,
        mut progress: impl FnMut(u64),
    ) -> Result<u64> {
        // By ctid: a tid scan, whatever the table's key.
        let sql = format!(
            "DELETE FROM {table} WHERE ctid = ANY(ARRAY( \
                 SELECT ctid FROM {table} WHERE {condition} ORDER BY {age} \
                 LIMIT $2 FOR UPDATE SKIP LOCKED))",
            table = table.table_name(),
            condition = table.condition(),
            age = table.age_column(),
        );
        let mut total = 0u64;
        loop {
            let deleted = sqlx::query(&sql)
                .bind(cutoff)
                .bind(self.batch_size)
                .execute(&self.pool)
                .await?
                .rows_affected();
            if deleted == 0 {
                return Ok(total);
            }
            total += deleted;
            progress(total);
        }
    }
}
