//! Retention: deleting old published outbox rows, processed inbox rows and dedup rows.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use super::partitions;
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
    pub(super) fn condition(self) -> &'static str {
        match self {
            CleanupTable::Outbox => "published_at < $1",
            CleanupTable::Inbox => "processed AND processed_at < $1",
            CleanupTable::ProcessedEvent => "processed_at < $1",
        }
    }

    /// The column the condition's index is on.
    pub(super) fn age_column(self) -> &'static str {
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

    /// How many rows of `table` [`run`](Self::run) would remove at `cutoff` (what a dry run
    /// reports): the rows past it, or, of a partitioned table, the rows of its partitions that
    /// end at or before it (and those of its first partition past it).
    pub async fn count(&self, table: CleanupTable, cutoff: DateTime<Utc>) -> Result<u64> {
        if let Some(layout) = partitions::partitions(&self.pool, table).await? {
            let mut rows = 0;
            for p in &layout.partitions {
                let past = p.to.is_some_and(|to| to <= cutoff);
                if !past && p.from.is_some() {
                    continue;
                }
                // A partition past the cut-off goes whole unless kept; one kept, and the first
                // partition not past yet, lose only their rows settled before the cut-off.
                let whole = past
                    && partitions::kept_because(&self.pool, table, &p.name, cutoff)
                        .await?
                        .is_none();
                let which = if whole {
                    "$1 IS NOT NULL"
                } else {
                    table.condition()
                };
                let n: i64 = sqlx::query_scalar(&format!(
                    "SELECT count(*) FROM {} WHERE {which}",
                    partitions::quote(&p.name)
                ))
                .bind(cutoff)
                .fetch_one(&self.pool)
                .await?;
                rows += n.max(0) as u64;
            }
            return Ok(rows);
        }
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
    ///
    /// A partitioned table (each of a new installation's, a converted one's) loses whole
    /// partitions instead: those that end at or before `cutoff`, detached concurrently and
    /// dropped, which leaves nothing for vacuum. Its rows are so kept up to one partition width
    /// longer than `cutoff` says. An `outbox_event` or `inbox_event` partition that still holds
    /// an unpublished, parked, unprocessed or dead row (reported by `outbox status`), or a row
    /// settled after `cutoff`, is kept, and loses only its rows settled before `cutoff`. So
    /// does the first partition until it is past `cutoff` (it takes everything from before the
    /// partitions began: a converted table's rows).
    pub async fn run(
        &self,
        table: CleanupTable,
        cutoff: DateTime<Utc>,
        progress: impl FnMut(u64),
    ) -> Result<u64> {
        Ok(self.remove(table, cutoff, progress).await?.rows)
    }

    /// [`run`](Self::run), saying also which partitions it dropped.
    async fn remove(
        &self,
        table: CleanupTable,
        cutoff: DateTime<Utc>,
        mut progress: impl FnMut(u64),
    ) -> Result<partitions::DroppedPartitions> {
        if let Some(layout) = partitions::partitions(&self.pool, table).await? {
            let dropped =
                partitions::drop_partitions(&self.pool, layout, cutoff, self.batch_size).await?;
            progress(dropped.rows);
            return Ok(dropped);
        }
        let rows = super::delete::delete_in_batches(
            &self.pool,
            table.table_name(),
            table.condition(),
            table.age_column(),
            cutoff,
            self.batch_size,
            progress,
        )
        .await?;
        Ok(partitions::DroppedPartitions {
            rows,
            ..Default::default()
        })
    }
}

/// Second key of the advisory lock that lets one retention run at a time; the first key is the
/// outbox table's oid (as the relay's locks), so that two schemas' retentions never block each
/// other.
const RETENTION_KEY: i32 = 0x5200_0000; // "R"

/// Retention on a schedule, for a relay to run beside publishing
/// ([`RelayBuilder::retention`](crate::relay::RelayBuilder::retention)), so that no separate job
/// needs deploying: each relay process runs it when it starts and then every
/// [`every`](Self::every), under an advisory lock, so that runs never overlap (one that finds
/// the lock taken skips its turn; a run that finds nothing to delete costs three index scans).
/// It runs [`Cleanup`] on the three tables: published outbox rows older than `older_than`, processed inbox rows and
/// `processed_event` rows older than [`dedup_older_than`](Self::dedup_older_than). Never an
/// unpublished, parked, unprocessed or dead row. A partitioned `processed_event` or
/// `inbox_event` loses whole partitions instead (those that end before the cut-off; an inbox
/// partition only once every row in it is processed), and each run first creates the
/// partitions missing ahead ([`create_partitions`](super::create_partitions)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Retention {
    older_than: Duration,
    dedup_older_than: Option<Duration>,
    every: Duration,
    batch_size: u32,
}

/// What one [`Retention::run_once`] deleted, per table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[non_exhaustive]
pub struct RetentionReport {
    /// Published `outbox_event` rows.
    pub outbox: u64,
    /// `outbox_event` partitions dropped (when it is partitioned), their rows counted in
    /// `outbox`.
    pub outbox_partitions_dropped: u64,
    /// Processed `inbox_event` rows.
    pub inbox: u64,
    /// `processed_event` rows.
    pub processed_event: u64,
    /// `processed_event` partitions dropped (when it is partitioned), their rows counted in
    /// `processed_event`.
    pub processed_event_partitions_dropped: u64,
    /// `inbox_event` partitions dropped (when it is partitioned), their rows counted in
    /// `inbox`.
    pub inbox_partitions_dropped: u64,
    /// Partitions past the window kept because they still hold an unprocessed or dead row
    /// (named, with the reason, in the log and by `outbox status`).
    pub partitions_kept: u64,
    /// Partitions created ahead, of every partitioned table.
    pub partitions_created: u64,
}

impl Retention {
    /// Published rows older than `older_than` go (and the dedup records with them unless
    /// [`dedup_older_than`](Self::dedup_older_than) says otherwise); every hour; batches of
    /// 10,000 rows.
    pub fn new(older_than: Duration) -> Self {
        Retention {
            older_than,
            dedup_older_than: None,
            every: Duration::from_secs(60 * 60),
            batch_size: 10_000,
        }
    }

    /// Keeps the dedup records (`processed_event`, processed `inbox_event` rows) this long
    /// instead: at least as long as `older_than` (a replay can resend anything still in the
    /// outbox) and as the topics' retention. See the operations guide on sizing it.
    pub fn dedup_older_than(mut self, older_than: Duration) -> Self {
        self.dedup_older_than = Some(older_than);
        self
    }

    /// How often it runs (default 1 hour; at least 1 s). Both windows must be a minute at
    /// least.
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every;
        self
    }

    /// Rows deleted per transaction (default 10,000).
    pub fn batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// How often it runs.
    pub fn interval(&self) -> Duration {
        self.every
    }

    /// `Err(Error::Config)` names the setting that cannot work.
    pub(crate) fn check(&self) -> Result<()> {
        let windows = [Some(self.older_than), self.dedup_older_than];
        if windows
            .into_iter()
            .flatten()
            .any(|w| w < Duration::from_secs(60))
        {
            return Err(Error::Config(format!(
                "retention shorter than a minute ({:?}; dedup {:?}) deletes what was just \
                 published or handled: is it a typo (30s for 30d)?",
                self.older_than, self.dedup_older_than
            )));
        }
        if self.every < Duration::from_secs(1) {
            return Err(Error::Config(format!(
                "retention must run at least a second apart, not every {:?}",
                self.every
            )));
        }
        if self.dedup_older_than.is_some_and(|d| d < self.older_than) {
            return Err(Error::Config(format!(
                "retention: dedup_older_than ({:?}) is shorter than older_than ({:?}): a replay \
                 of an event still in the outbox would be handled again",
                self.dedup_older_than.unwrap_or_default(),
                self.older_than
            )));
        }
        Ok(())
    }

    /// [`run_once`](Self::run_once) on MariaDB/MySQL: published outbox rows and dedup records
    /// past their windows, in batches ([`MySqlCleanup`](crate::mysql::Cleanup)), unless another
    /// relay of the database is running it (a `GET_LOCK` on a connection of its own, which goes
    /// with it however the run ends).
    #[cfg(feature = "mysql")]
    pub async fn run_once_mysql(&self, pool: &sqlx::MySqlPool) -> Result<Option<RetentionReport>> {
        self.check()?;
        let dedup_older_than = self.dedup_older_than.unwrap_or(self.older_than);
        super::mysql_cleanup::retention(pool, self.older_than, dedup_older_than, self.batch_size)
            .await
    }

    /// Runs once, unless another instance is running it: `Ok(None)` then. The lock is a
    /// transaction-scoped advisory lock, held by a transaction of its own on a connection of
    /// its own while the batches run on others: that transaction has no id and holds no snapshot
    /// between its statements, so it holds back no cleanup, and however the run ends (an error,
    /// a cancelled task, a lost connection) the lock goes with the transaction.
    pub async fn run_once(&self, pool: &PgPool) -> Result<Option<RetentionReport>> {
        self.check()?;
        let mut lock = pool.begin().await?;
        // Whatever the role's default: a repeatable-read transaction would keep its snapshot
        // for the whole run, and hold back the cleanup of every table.
        sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut *lock)
            .await?;
        let space: Option<i64> =
            sqlx::query_scalar("SELECT to_regclass('outbox_event')::oid::int8")
                .fetch_one(&mut *lock)
                .await?;
        let Some(space) = space else {
            return Err(Error::Config(
                "no outbox_event table on the search_path: run the migrations".into(),
            ));
        };
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1, $2)")
            .bind(space as u32 as i32)
            .bind(RETENTION_KEY)
            .fetch_one(&mut *lock)
            .await?;
        if !locked {
            return Ok(None);
        }
        let report = self.cut(pool).await?;
        // The lock's transaction wrote nothing: if the server ended it meanwhile (an
        // `idle_in_transaction_session_timeout` shorter than the run), the run still stands.
        let _ = lock.commit().await;
        Ok(Some(report))
    }

    async fn cut(&self, pool: &PgPool) -> Result<RetentionReport> {
        let outbox = Cleanup::new(pool.clone(), self.older_than).batch_size(self.batch_size);
        let dedup = Cleanup::new(
            pool.clone(),
            self.dedup_older_than.unwrap_or(self.older_than),
        )
        .batch_size(self.batch_size);
        // Partitions ahead first: this job runs on a schedule anyway.
        // A failure here (a lock that did not come within its timeout) must not cost the run.
        let mut report = RetentionReport::default();
        for table in CleanupTable::ALL {
            let created = partitions::create_partitions(pool, table)
                .await
                .unwrap_or_else(|e| {
                    tracing::warn!(table = table.table_name(), error = %crate::error_chain(&e), "cannot create partitions ahead; the next run tries again");
                    0
                });
            #[cfg(feature = "_broker")]
            metrics::counter!("outbox_partitions_created_total", "table" => table.table_name())
                .increment(u64::from(created));
            report.partitions_created += u64::from(created);
        }
        // A table that fails (a detach that timed out, say) does not cost the others their
        // run; the first error is returned once all were tried.
        let mut failed = None;
        for table in CleanupTable::ALL {
            let cleanup = match table {
                CleanupTable::Outbox => &outbox,
                _ => &dedup,
            };
            let removed = match cleanup.remove(table, cleanup.cutoff().await?, |_| {}).await {
                Ok(removed) => removed,
                Err(e) => {
                    tracing::warn!(table = table.table_name(), error = %crate::error_chain(&e), "retention failed for a table; the others go on");
                    failed.get_or_insert(e);
                    continue;
                }
            };
            report.partitions_kept += removed.kept.len() as u64;
            match table {
                CleanupTable::Outbox => {
                    report.outbox = removed.rows;
                    report.outbox_partitions_dropped = removed.dropped.len() as u64;
                }
                CleanupTable::Inbox => {
                    report.inbox = removed.rows;
                    report.inbox_partitions_dropped = removed.dropped.len() as u64;
                }
                CleanupTable::ProcessedEvent => {
                    report.processed_event = removed.rows;
                    report.processed_event_partitions_dropped = removed.dropped.len() as u64;
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }
}
