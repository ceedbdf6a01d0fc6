//! When a figure becomes a warning: [`HealthThresholds`].

use std::time::Duration;

use super::warning::WarningKind;

/// Tables under this many dead rows are never reported as overdue for a vacuum: a table that
/// barely changes needs none.
pub const VACUUM_OVERDUE_MIN_DEAD_ROWS: i64 = 10_000;

/// When a figure becomes a warning, and which kinds of warning to leave out. The defaults suit
/// a service publishing hundreds to thousands of events a second; each setter says what its
/// figure means.
#[derive(Debug, Clone, PartialEq)]
#[must_use]
pub struct HealthThresholds {
    pub(super) unpublished_age: Duration,
    pub(super) unprocessed_age: Duration,
    pub(super) dead_rows: i64,
    pub(super) vacuum_age: Duration,
    pub(super) transaction_age: Duration,
    pub(super) idle_transaction_age: Duration,
    pub(super) lock_wait: Duration,
    pub(super) slot_xmin_age: i64,
    pub(super) partitions_ahead: Duration,
    pub(super) max_partitions: usize,
    pub(super) ignored: Vec<WarningKind>,
}

impl Default for HealthThresholds {
    fn default() -> Self {
        HealthThresholds {
            unpublished_age: Duration::from_secs(60),
            unprocessed_age: Duration::from_secs(5 * 60),
            dead_rows: 500_000,
            vacuum_age: Duration::from_secs(60 * 60),
            transaction_age: Duration::from_secs(5 * 60),
            idle_transaction_age: Duration::from_secs(30),
            lock_wait: Duration::from_secs(10),
            slot_xmin_age: 1_000_000,
            partitions_ahead: Duration::from_secs(24 * 60 * 60),
            max_partitions: 60,
            ignored: Vec::new(),
        }
    }
}

impl HealthThresholds {
    /// Warns when a row has waited longer than this to be published (default 1 minute).
    pub fn unpublished_age(mut self, age: Duration) -> Self {
        self.unpublished_age = age;
        self
    }

    /// Warns when an inbox row has waited longer than this to be processed (default 5
    /// minutes; rows waiting for a retry count too).
    pub fn unprocessed_age(mut self, age: Duration) -> Self {
        self.unprocessed_age = age;
        self
    }

    /// Warns when one of the framework's tables holds more dead rows than this (default
    /// 500,000): every claim of the relay walks past them until a vacuum removes them.
    pub fn dead_rows(mut self, rows: i64) -> Self {
        self.dead_rows = rows;
        self
    }

    /// Warns when autovacuum is not keeping up with a table (a partition of a partitioned
    /// one) with at least [`VACUUM_OVERDUE_MIN_DEAD_ROWS`] dead rows, more than autovacuum's
    /// own trigger for it (or autovacuum off for it): not vacuumed for longer than this since
    /// its last vacuum, or, never vacuumed, since it could first hold rows (default 1 hour).
    pub fn vacuum_age(mut self, age: Duration) -> Self {
        self.vacuum_age = age;
        self
    }

    /// Warns when a session's transaction (or a prepared transaction) has held back the
    /// cleanup horizon longer than this (default 5 minutes). A relay's batch holds one for at
    /// most its publish timeout.
    pub fn transaction_age(mut self, age: Duration) -> Self {
        self.transaction_age = age;
        self
    }

    /// Warns sooner of a session that has sat *idle* in its transaction this long in one
    /// stretch (default 30 s, or [`transaction_age`](Self::transaction_age) if that is
    /// shorter): a forgotten `BEGIN`, a connection leaked mid-transaction, or a transaction
    /// kept open around a slow call to another service; it holds the horizon while it waits.
    /// A busy transaction may rightly run for minutes.
    pub fn idle_transaction_age(mut self, age: Duration) -> Self {
        self.idle_transaction_age = age;
        self
    }

    /// On MariaDB/MySQL, warns when a transaction has waited for a row lock longer than this
    /// (default 10 s), naming the connection whose transaction holds it: an emitter waiting
    /// for its key's lock row behind a long transaction of the same key, or a statement
    /// waiting behind an operator's. InnoDB gives up on a wait after `innodb_lock_wait_timeout`
    /// (50 s by default).
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = wait;
        self
    }

    /// Warns when an active replication slot holds the horizon more than this many
    /// transactions back (default 1,000,000); an inactive slot that holds it is always a
    /// warning.
    pub fn slot_xmin_age(mut self, transactions: i64) -> Self {
        self.slot_xmin_age = transactions;
        self
    }

    /// Warns when a partitioned table's partitions reach less than this far past now (default
    /// 1 day, or half the table's own `ahead` setting if that is less): once they end, inserts
    /// fail until something creates more.
    pub fn partitions_ahead(mut self, ahead: Duration) -> Self {
        self.partitions_ahead = ahead;
        self
    }

    /// Warns when the outbox or the inbox has more partitions than this (default 60): every
    /// claim of a relay (of an inbox processor) reads each of them, so its rate falls with
    /// their number (BENCHMARKS.md: a relay at 0.56x with 90 daily partitions, 0.19x with
    /// 365). Retention keeps their number bounded.
    pub fn max_partitions(mut self, partitions: usize) -> Self {
        self.max_partitions = partitions;
        self
    }

    /// Leaves out warnings of this kind: for example [`WarningKind::AutovacuumOff`] on a server
    /// whose operators vacuum on a schedule of their own.
    pub fn ignore(mut self, kind: WarningKind) -> Self {
        if !self.ignored.contains(&kind) {
            self.ignored.push(kind);
        }
        self
    }

    /// Whether warnings of this kind are left out.
    pub fn ignores(&self, kind: WarningKind) -> bool {
        self.ignored.contains(&kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ignored_kinds_are_listed_once() {
        let t = HealthThresholds::default()
            .ignore(WarningKind::AutovacuumOff)
            .ignore(WarningKind::AutovacuumOff);
        assert!(t.ignores(WarningKind::AutovacuumOff));
        assert!(!t.ignores(WarningKind::Parked));
        assert_eq!(t.ignored.len(), 1);
    }
}
