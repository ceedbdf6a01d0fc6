//! When `status`, `relay` and `console` warn about the outbox's health.

use std::time::Duration;

use clap::Args;

use crate::parse;

/// When `status` and `relay` warn about the outbox's health.
#[derive(Debug, Args)]
pub struct Thresholds {
    /// Warn when an event has waited longer than this to be published [default: 1m]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    pub warn_unpublished_age: Option<Duration>,
    /// Warn when an inbox row has waited longer than this to be processed [default: 5m]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    pub warn_unprocessed_age: Option<Duration>,
    /// Warn when an outbox or inbox table holds more dead rows than this [default: 500000]
    #[arg(long, value_name = "ROWS")]
    pub warn_dead_rows: Option<i64>,
    /// Warn when a table with 10000 dead rows or more was last vacuumed longer ago than this
    /// [default: 1h]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    pub warn_vacuum_age: Option<Duration>,
    /// Warn when a session or a prepared transaction has held back the cleanup horizon longer
    /// than this [default: 5m]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    pub warn_transaction_age: Option<Duration>,
    /// Warn sooner of a session idle in its transaction this long in one stretch (it holds
    /// the cleanup horizon while it waits) [default: 30s]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    pub warn_idle_transaction_age: Option<Duration>,
    /// MariaDB/MySQL: warn when a transaction has waited for a row lock longer than this,
    /// naming the connection that holds it [default: 10s]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    pub warn_lock_wait: Option<Duration>,
    /// Warn when a partitioned table's partitions reach less than this past now [default: 1d,
    /// or half the layout's ahead if less]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    pub warn_partitions_ahead: Option<Duration>,
    /// Warn when the outbox or the inbox has more partitions than this (every claim reads
    /// each of them) [default: 60]
    #[arg(long, value_name = "PARTITIONS")]
    pub warn_partitions: Option<usize>,
    /// Leave out warnings of this kind; repeatable. Kinds: autovacuum_off, dead_rows,
    /// vacuum_overdue, long_transaction, replication_slot, standby_feedback, prepared_transaction,
    /// old_unpublished, old_unprocessed, held_keys, parked, dead_inbox, missing_topic,
    /// partitions_not_ahead, partition_not_dropped, many_partitions, conversion_interrupted
    #[arg(long, value_name = "KIND")]
    pub ignore: Vec<outbox_runtime::admin::WarningKind>,
}

impl Thresholds {
    pub fn health(&self) -> outbox_runtime::admin::HealthThresholds {
        let mut t = outbox_runtime::admin::HealthThresholds::default();
        if let Some(age) = self.warn_unpublished_age {
            t = t.unpublished_age(age);
        }
        if let Some(age) = self.warn_unprocessed_age {
            t = t.unprocessed_age(age);
        }
        if let Some(rows) = self.warn_dead_rows {
            t = t.dead_rows(rows);
        }
        if let Some(age) = self.warn_vacuum_age {
            t = t.vacuum_age(age);
        }
        if let Some(age) = self.warn_transaction_age {
            t = t.transaction_age(age);
        }
        if let Some(age) = self.warn_idle_transaction_age {
            t = t.idle_transaction_age(age);
        }
        if let Some(wait) = self.warn_lock_wait {
            t = t.lock_wait(wait);
        }
        if let Some(ahead) = self.warn_partitions_ahead {
            t = t.partitions_ahead(ahead);
        }
        if let Some(partitions) = self.warn_partitions {
            t = t.max_partitions(partitions);
        }
        self.ignore.iter().fold(t, |t, kind| t.ignore(*kind))
    }
}
