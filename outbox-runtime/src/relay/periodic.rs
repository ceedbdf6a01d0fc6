//! What a relay runs now and then beside publishing, on tasks of their own so that none holds
//! up a batch: its health checks (`health.rs`) and retention.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::admin::Retention;

/// When a periodic job is next due, for a relay's instances to agree on which of them runs it.
pub(super) struct Schedule {
    every: Duration,
    next: Mutex<Option<Instant>>,
}

impl Schedule {
    /// Due at once, then every `every` (`Duration::ZERO`: never).
    pub(super) fn new(every: Duration) -> Schedule {
        Schedule {
            every,
            next: Mutex::new(None),
        }
    }

    /// Whether the job is due; the caller that gets `true` runs it, the others wait for the
    /// next time.
    pub(super) fn claim_due(&self) -> bool {
        if self.every.is_zero() {
            return false;
        }
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if next.is_some_and(|at| now < at) {
            return false;
        }
        *next = Some(now + self.every);
        true
    }

    /// The interval.
    pub(super) fn every(&self) -> Duration {
        self.every
    }
}

/// A relay's retention and when it runs next.
pub(super) struct RetentionRuns {
    retention: Retention,
    schedule: Schedule,
}

impl RetentionRuns {
    pub(super) fn new(retention: Retention) -> RetentionRuns {
        let schedule = Schedule::new(retention.interval());
        RetentionRuns {
            retention,
            schedule,
        }
    }

    /// Whether a run is due; the caller that gets `true` runs it.
    pub(super) fn claim_due(&self) -> bool {
        self.schedule.claim_due()
    }

    /// Runs it once (unless another instance of any relay on the database is running it) and
    /// reports it: a log line with what it deleted, `outbox_retention_deleted_total{table}`,
    /// `outbox_partitions_dropped_total{table}`, `outbox_partitions_created_total{table}`
    /// (counted where they are created) and `outbox_partitions_kept` (partitions past the
    /// window kept for an unpublished or parked outbox row, an unprocessed or dead inbox row), or a warning with the error.
    pub(super) async fn run(&self, pool: &PgPool) {
        self.report(self.retention.run_once(pool).await);
    }

    /// [`run`](Self::run) on MariaDB/MySQL (no partitions there: rows deleted in batches).
    #[cfg(feature = "mysql")]
    pub(super) async fn run_mysql(&self, pool: &sqlx::MySqlPool) {
        self.report(self.retention.run_once_mysql(pool).await);
    }

    /// Reports a run.
    fn report(&self, run: crate::Result<Option<crate::admin::RetentionReport>>) {
        match run {
            Ok(Some(report)) => {
                for (table, n) in [
                    ("outbox_event", report.outbox),
                    ("inbox_event", report.inbox),
                    ("processed_event", report.processed_event),
                ] {
                    metrics::counter!("outbox_retention_deleted_total", "table" => table)
                        .increment(n);
                }
                for (table, n) in [
                    ("outbox_event", report.outbox_partitions_dropped),
                    ("inbox_event", report.inbox_partitions_dropped),
                    ("processed_event", report.processed_event_partitions_dropped),
                ] {
                    metrics::counter!("outbox_partitions_dropped_total", "table" => table)
                        .increment(n);
                }
                metrics::gauge!("outbox_partitions_kept").set(report.partitions_kept as f64);
                tracing::info!(
                    outbox = report.outbox,
                    inbox = report.inbox,
                    processed_event = report.processed_event,
                    outbox_partitions_dropped = report.outbox_partitions_dropped,
                    inbox_partitions_dropped = report.inbox_partitions_dropped,
                    processed_event_partitions_dropped = report.processed_event_partitions_dropped,
                    partitions_created = report.partitions_created,
                    partitions_kept = report.partitions_kept,
                    "outbox retention: deleted the rows past the retention"
                );
            }
            Ok(None) => {
                tracing::debug!("outbox retention: another instance is running it");
            }
            Err(e) => {
                tracing::warn!(error = %crate::error_chain(&e), "outbox retention failed; it runs again at its next time");
            }
        }
    }
}
