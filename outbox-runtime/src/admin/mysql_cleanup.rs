//! Retention on MariaDB/MySQL ([`MySqlCleanup`], `outbox cleanup` with a `mysql://` URL):
//! published outbox rows and dedup rows older than a cut-off, deleted in short batches. Neither
//! table is partitioned there; each batch is one `DELETE ... ORDER BY <age> LIMIT n` on the
//! age's index, its own transaction at READ COMMITTED (no gap locks that would stall an
//! emitter or a consumer), so nothing is locked for long and each batch's undo stays small.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Executor, MySqlPool};

use super::{CleanupTable, RetentionReport};
use crate::error::{Error, Result};

/// Retention on a MariaDB/MySQL database; see the module's docs. The same steps as
/// [`Cleanup`](super::Cleanup): take the [`cutoff`](Self::cutoff) once, [`count`](Self::count)
/// (a dry run), then [`run`](Self::run).
#[derive(Debug, Clone)]
pub struct MySqlCleanup {
    pool: MySqlPool,
    older_than: Duration,
    batch_size: u32,
}

impl MySqlCleanup {
    /// Rows older than `older_than` (by the database's clock) go; batches of 10,000 rows.
    pub fn new(pool: MySqlPool, older_than: Duration) -> Self {
        MySqlCleanup {
            pool,
            older_than,
            batch_size: 10_000,
        }
    }

    /// Rows deleted per statement (default 10,000; at least 1).
    #[must_use]
    pub fn batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// The cut-off: now, by the database's clock (UTC), minus `older_than`.
    pub async fn cutoff(&self) -> Result<DateTime<Utc>> {
        let micros = i64::try_from(self.older_than.as_micros()).unwrap_or(i64::MAX);
        let cutoff: chrono::NaiveDateTime =
            sqlx::query_scalar("SELECT UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND")
                .bind(micros)
                .fetch_one(&self.pool)
                .await?;
        Ok(cutoff.and_utc())
    }

    /// How many rows of `table` [`run`](Self::run) would delete at `cutoff`.
    pub async fn count(&self, table: CleanupTable, cutoff: DateTime<Utc>) -> Result<u64> {
        let column = age_column(table)?;
        let sql = format!(
            "SELECT COUNT(*) FROM {} WHERE {column} < ?",
            table.table_name()
        );
        let n: i64 = sqlx::query_scalar(&sql)
            .bind(cutoff.naive_utc())
            .fetch_one(&self.pool)
            .await?;
        Ok(n.max(0) as u64)
    }

    /// Deletes the rows of `table` past `cutoff`, a batch per statement, calling `progress`
    /// with the total so far after each. Returns how many it deleted. Unpublished and parked
    /// outbox rows are never deleted (their `published_at` is NULL).
    pub async fn run(
        &self,
        table: CleanupTable,
        cutoff: DateTime<Utc>,
        mut progress: impl FnMut(u64),
    ) -> Result<u64> {
        let column = age_column(table)?;
        let sql = format!(
            "DELETE FROM {} WHERE {column} < ? ORDER BY {column} LIMIT ?",
            table.table_name()
        );
        // A connection of its own, at READ COMMITTED for its session: it goes back to the pool
        // with the server's default again only by being closed.
        let mut conn = self.pool.acquire().await?.detach();
        conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .await?;
        let mut total = 0;
        loop {
            let deleted = sqlx::query(&sql)
                .bind(cutoff.naive_utc())
                .bind(self.batch_size)
                .execute(&mut conn)
                .await?
                .rows_affected();
            total += deleted;
            progress(total);
            if deleted < u64::from(self.batch_size) {
                return Ok(total);
            }
        }
    }
}

/// The column whose age says a row of `table` may go.
fn age_column(table: CleanupTable) -> Result<&'static str> {
    match table {
        CleanupTable::Outbox => Ok("published_at"),
        CleanupTable::ProcessedEvent => Ok("processed_at"),
        CleanupTable::Inbox => Err(Error::Config(
            "inbox_event is not built on MariaDB/MySQL yet (inbox mode): nothing to clean".into(),
        )),
    }
}

/// One run of a relay's retention ([`Retention::run_once_mysql`](super::Retention)): `None` if
/// another relay of the database holds its lock.
pub(super) async fn retention(
    pool: &MySqlPool,
    older_than: Duration,
    dedup_older_than: Duration,
    batch_size: u32,
) -> Result<Option<RetentionReport>> {
    // Out of the pool: the lock goes with the connection, however the run ends.
    let mut lock = pool.acquire().await?.detach();
    let locked: Option<i64> =
        sqlx::query_scalar("SELECT GET_LOCK(CONCAT('outbox:retention:', MD5(DATABASE())), 0)")
            .fetch_one(&mut lock)
            .await?;
    if locked != Some(1) {
        return Ok(None);
    }
    let mut report = RetentionReport::default();
    for (table, window) in [
        (CleanupTable::Outbox, older_than),
        (CleanupTable::ProcessedEvent, dedup_older_than),
    ] {
        let cleanup = MySqlCleanup::new(pool.clone(), window).batch_size(batch_size);
        let cutoff = cleanup.cutoff().await?;
        let deleted = cleanup.run(table, cutoff, |_| {}).await?;
        match table {
            CleanupTable::Outbox => report.outbox = deleted,
            _ => report.processed_event = deleted,
        }
    }
    Ok(Some(report))
}
