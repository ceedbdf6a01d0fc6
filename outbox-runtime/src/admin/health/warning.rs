//! The warnings: [`Warning`], what each names, and [`WarningKind`], what they are counted and
//! ignored by. Their one-line text is in `display.rs`.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// The kind of a [`Warning`]: its `kind` in JSON, its label on the `outbox_health_warnings`
/// gauge, and what [`HealthThresholds::ignore`](super::HealthThresholds::ignore) and `outbox status --ignore` take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum WarningKind {
    /// See [`Warning::AutovacuumOff`].
    AutovacuumOff,
    /// See [`Warning::DeadRows`].
    DeadRows,
    /// See [`Warning::VacuumOverdue`].
    VacuumOverdue,
    /// See [`Warning::LongTransaction`].
    LongTransaction,
    /// See [`Warning::ReplicationSlot`].
    ReplicationSlot,
    /// See [`Warning::StandbyFeedback`].
    StandbyFeedback,
    /// See [`Warning::PreparedTransaction`].
    PreparedTransaction,
    /// See [`Warning::OldUnpublished`].
    OldUnpublished,
    /// See [`Warning::OldUnprocessed`].
    OldUnprocessed,
    /// See [`Warning::HeldKeys`].
    HeldKeys,
    /// See [`Warning::Parked`].
    Parked,
    /// See [`Warning::DeadInbox`].
    DeadInbox,
    /// See [`Warning::MissingTopic`].
    MissingTopic,
    /// See [`Warning::PartitionsNotAhead`].
    PartitionsNotAhead,
    /// See [`Warning::PartitionNotDropped`].
    PartitionNotDropped,
    /// See [`Warning::ManyPartitions`].
    ManyPartitions,
    /// See [`Warning::ConversionInterrupted`].
    ConversionInterrupted,
    /// See [`Warning::LockWait`].
    LockWait,
}

impl WarningKind {
    /// Every kind, in the order `outbox status` lists them.
    pub const ALL: [WarningKind; 18] = [
        WarningKind::AutovacuumOff,
        WarningKind::DeadRows,
        WarningKind::VacuumOverdue,
        WarningKind::LongTransaction,
        WarningKind::ReplicationSlot,
        WarningKind::StandbyFeedback,
        WarningKind::PreparedTransaction,
        WarningKind::OldUnpublished,
        WarningKind::OldUnprocessed,
        WarningKind::HeldKeys,
        WarningKind::Parked,
        WarningKind::DeadInbox,
        WarningKind::MissingTopic,
        WarningKind::PartitionsNotAhead,
        WarningKind::PartitionNotDropped,
        WarningKind::ManyPartitions,
        WarningKind::ConversionInterrupted,
        WarningKind::LockWait,
    ];

    /// The kind's name, as JSON and the gauge's label spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            WarningKind::AutovacuumOff => "autovacuum_off",
            WarningKind::DeadRows => "dead_rows",
            WarningKind::VacuumOverdue => "vacuum_overdue",
            WarningKind::LongTransaction => "long_transaction",
            WarningKind::ReplicationSlot => "replication_slot",
            WarningKind::StandbyFeedback => "standby_feedback",
            WarningKind::PreparedTransaction => "prepared_transaction",
            WarningKind::OldUnpublished => "old_unpublished",
            WarningKind::OldUnprocessed => "old_unprocessed",
            WarningKind::HeldKeys => "held_keys",
            WarningKind::Parked => "parked",
            WarningKind::DeadInbox => "dead_inbox",
            WarningKind::MissingTopic => "missing_topic",
            WarningKind::PartitionsNotAhead => "partitions_not_ahead",
            WarningKind::PartitionNotDropped => "partition_not_dropped",
            WarningKind::ManyPartitions => "many_partitions",
            WarningKind::ConversionInterrupted => "conversion_interrupted",
            WarningKind::LockWait => "lock_wait",
        }
    }
}

impl fmt::Display for WarningKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for WarningKind {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let wanted = s.trim().replace('-', "_");
        WarningKind::ALL
            .into_iter()
            .find(|k| k.as_str() == wanted)
            .ok_or_else(|| {
                let all: Vec<&str> = WarningKind::ALL.iter().map(|k| k.as_str()).collect();
                format!(
                    "unknown warning kind `{s}`: expected one of {}",
                    all.join(", ")
                )
            })
    }
}

/// One problem [`health`](super::health) found, with what an operator needs to find its cause. Its `Display`
/// is one line that names the cause and what to do.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Warning {
    /// Autovacuum cannot clean one of the framework's tables: it is off for the server
    /// (`table` is `None`; `autovacuum` or `track_counts` is off) or for this table
    /// (`autovacuum_enabled = false`). Dead rows pile up unless something else runs `VACUUM`.
    AutovacuumOff {
        /// The table (a partition of a partitioned one: where the setting is), or `None` for
        /// the whole server.
        table: Option<String>,
        /// The setting that turns it off, as `name = value`.
        setting: String,
    },
    /// A table holds more dead rows than [`HealthThresholds::dead_rows`](super::HealthThresholds::dead_rows).
    DeadRows {
        /// The table.
        table: String,
        /// Its dead rows (PostgreSQL's estimate).
        dead: i64,
        /// Its live rows (PostgreSQL's estimate).
        live: i64,
    },
    /// Not reported any more: [`Warning::VacuumBehind`] is, of the same kind. (It took a
    /// partition never vacuumed for one last vacuumed at its lower bound, even when the
    /// partition was created hours after that, and warned whatever autovacuum's own trigger.)
    VacuumOverdue {
        /// The table.
        table: String,
        /// Its dead rows.
        dead: i64,
        /// Seconds since its last vacuum, by hand or automatic; `None`: never (since the
        /// statistics were last reset).
        last_vacuum_age_secs: Option<f64>,
    },
    /// Autovacuum is not keeping up with a table (a partition of a partitioned one): it holds
    /// at least [`VACUUM_OVERDUE_MIN_DEAD_ROWS`](super::VACUUM_OVERDUE_MIN_DEAD_ROWS) dead rows,
    /// more than autovacuum's trigger for it (or autovacuum cannot vacuum it), no vacuum runs
    /// on it, and none has for longer than
    /// [`HealthThresholds::vacuum_age`](super::HealthThresholds::vacuum_age): since its last
    /// vacuum, or, never vacuumed, since it could first hold rows (see `rows_age_secs`). Its
    /// kind is [`WarningKind::VacuumOverdue`] (in JSON too).
    #[serde(rename = "vacuum_overdue")]
    VacuumBehind {
        /// The table.
        table: String,
        /// Its partition, on a partitioned table: where the dead rows are (`VACUUM
        /// <partition>` removes them).
        partition: Option<String>,
        /// Its dead rows (PostgreSQL's estimate).
        dead: i64,
        /// The dead rows past which autovacuum vacuums it (its `autovacuum_vacuum_threshold`
        /// plus its scale factor times its rows); `None`: autovacuum cannot (off for the
        /// server or for it).
        autovacuum_at: Option<i64>,
        /// Seconds since its last vacuum, by hand or automatic; `None`: never (since the
        /// statistics were last reset).
        last_vacuum_age_secs: Option<f64>,
        /// At most how long it has been able to hold rows, in seconds: since the latest of the
        /// installation's first migration (no table of the framework is older), its lower
        /// bound (a partition holds no row from before it), and the statistics' last reset;
        /// `None` if none is known.
        rows_age_secs: Option<f64>,
    },
    /// A session of this database has held a transaction (or a snapshot) open longer than
    /// [`HealthThresholds::transaction_age`](super::HealthThresholds::transaction_age): no row that became dead after it started can be
    /// removed, in any table, until it ends.
    LongTransaction {
        /// The session's backend pid (`pg_terminate_backend(pid)` ends it).
        pid: i32,
        /// Its `application_name`.
        application_name: String,
        /// The role it connected as.
        user: String,
        /// Its state: `idle in transaction` is a transaction nobody is using.
        state: String,
        /// Seconds since its transaction began.
        age_secs: f64,
    },
    /// On MariaDB/MySQL, a transaction has been open longer than
    /// [`HealthThresholds::transaction_age`](super::HealthThresholds::transaction_age) (or idle
    /// in it longer than `idle_transaction_age`): InnoDB's purge cannot remove what changed
    /// after it began (the history list grows, and the relay's claims walk the marks it keeps).
    /// Of the kind `long_transaction`.
    InnodbTransaction {
        /// The connection's id (`KILL <id>` ends it).
        thread_id: i64,
        /// The client's host.
        host: String,
        /// The user it connected as.
        user: String,
        /// What it is doing (`Sleep`: a transaction nobody is using).
        command: String,
        /// Seconds since its transaction began.
        age_secs: f64,
        /// InnoDB's history list length (undo logs not purged yet), when it could be read.
        history_list_length: Option<i64>,
    },
    /// On MariaDB/MySQL, a transaction has waited for a row lock longer than
    /// [`HealthThresholds::lock_wait`](super::HealthThresholds::lock_wait).
    LockWait {
        /// The waiting connection's id.
        thread_id: i64,
        /// Its client's host.
        host: String,
        /// The user it connected as.
        user: String,
        /// Seconds it has waited.
        waited_secs: f64,
        /// The connection whose transaction holds the lock (`KILL <id>` ends it), when the
        /// server tells (MariaDB's `INNODB_LOCK_WAITS`, MySQL's `data_lock_waits`).
        blocking_thread_id: Option<i64>,
    },
    /// A replication slot holds the cleanup horizon: it is inactive, or its `xmin` is more
    /// than [`HealthThresholds::slot_xmin_age`](super::HealthThresholds::slot_xmin_age) transactions old.
    ReplicationSlot {
        /// The slot.
        slot_name: String,
        /// Whether a client is connected to it.
        active: bool,
        /// How many transactions old its `xmin` is.
        xmin_age: i64,
    },
    /// A standby's feedback (`hot_standby_feedback`, without a replication slot) holds the
    /// cleanup horizon more than [`HealthThresholds::slot_xmin_age`](super::HealthThresholds::slot_xmin_age) transactions back: a long
    /// query on the standby, for every database of the server.
    StandbyFeedback {
        /// The pid of the server's sender to that standby.
        pid: i32,
        /// The standby's `application_name`.
        application_name: String,
        /// How many transactions old the horizon it asks for is.
        xmin_age: i64,
    },
    /// A prepared (two-phase) transaction of this database has waited longer than
    /// [`HealthThresholds::transaction_age`](super::HealthThresholds::transaction_age) for its `COMMIT PREPARED` or `ROLLBACK PREPARED`.
    PreparedTransaction {
        /// Its global id.
        gid: String,
        /// The role that prepared it.
        owner: String,
        /// Seconds since it was prepared.
        age_secs: f64,
    },
    /// A topic's oldest unpublished row is older than [`HealthThresholds::unpublished_age`](super::HealthThresholds::unpublished_age).
    OldUnpublished {
        /// The topic.
        topic: String,
        /// The row's age in seconds.
        age_secs: f64,
    },
    /// A topic's oldest unprocessed inbox row is older than
    /// [`HealthThresholds::unprocessed_age`](super::HealthThresholds::unprocessed_age).
    OldUnprocessed {
        /// The topic.
        topic: String,
        /// The row's age in seconds.
        age_secs: f64,
    },
    /// Keys of a topic are held for an operator: the broker refused their rows for a reason
    /// only an operator can fix (a missing topic, a denied write).
    HeldKeys {
        /// The topic.
        topic: String,
        /// Rows waiting behind the hold.
        rows: i64,
        /// Partition keys held.
        keys: i64,
        /// The broker's error for one of them.
        error: Option<String>,
    },
    /// A topic has parked outbox rows (`outbox parked list`).
    Parked {
        /// The topic.
        topic: String,
        /// Parked rows.
        rows: i64,
    },
    /// A topic has dead inbox rows (`outbox inbox list`).
    DeadInbox {
        /// The topic.
        topic: String,
        /// Dead rows.
        rows: i64,
    },
    /// A consumer group found a retry or dead-letter topic missing when it started (or
    /// since): its first message that needs the topic will pause every partition of the
    /// consumer until the topic exists. `outbox topics ensure` creates it.
    MissingTopic {
        /// The consumer group.
        group: String,
        /// The missing topic.
        topic: String,
        /// The topic whose messages would go there.
        source: String,
        /// `retry` or `dead_letter`.
        role: String,
        /// Seconds since the consumer found it missing.
        age_secs: f64,
    },
    /// A partitioned table's partitions reach less than [`HealthThresholds::partitions_ahead`](super::HealthThresholds::partitions_ahead)
    /// past now: nothing has created partitions lately (no relay runs retention, no dedup
    /// consumer runs, or creating them fails: the relay's or consumer's log says why). Once
    /// they end, inserts fail until something creates more.
    PartitionsNotAhead {
        /// The table.
        table: String,
        /// Seconds past now its partitions reach (0: none takes rows now).
        covered_secs: f64,
    },
    /// A partition past retention was not dropped: its concurrent detach was interrupted (a
    /// transaction that could see it outlasted the detach's minute), so it is neither attached
    /// nor gone (retention finishes it at its next run; `ALTER TABLE <table> DETACH PARTITION
    /// <partition> FINALIZE` does it now); or retention kept it, because it still holds an
    /// unprocessed or dead inbox row (dead rows: `outbox inbox dead retry` or `discard`).
    PartitionNotDropped {
        /// The table.
        table: String,
        /// The partition.
        partition: String,
        /// Why it is still there.
        reason: String,
    },
    /// The outbox or the inbox has more partitions than [`HealthThresholds::max_partitions`](super::HealthThresholds::max_partitions):
    /// a relay's claim (an inbox processor's) reads every partition, so its rate falls with
    /// their number. Nothing drops them: no retention runs (`outbox relay --retention`,
    /// `outbox cleanup`), or its window is long for the partitions' width (`outbox partitions
    /// set --width` widens the partitions created from now on).
    ManyPartitions {
        /// The table.
        table: String,
        /// Its partitions.
        partitions: usize,
    },
    /// A conversion of a plain table to partitions stopped midway (killed, or failed and
    /// could not drop what it had added): the table still carries its bound,
    /// `<table>_before_partitions`, which refuses every insert from `refuses_from` on. Running
    /// the conversion again (`outbox partitions convert`) finishes it; dropping the constraint
    /// undoes it.
    ConversionInterrupted {
        /// The table.
        table: String,
        /// The constraint.
        constraint: String,
        /// From when it refuses inserts.
        refuses_from: chrono::DateTime<chrono::Utc>,
        /// Seconds until then (negative: already).
        in_secs: f64,
    },
}

impl Warning {
    /// The warning's kind.
    pub fn kind(&self) -> WarningKind {
        match self {
            Warning::AutovacuumOff { .. } => WarningKind::AutovacuumOff,
            Warning::DeadRows { .. } => WarningKind::DeadRows,
            Warning::VacuumOverdue { .. } | Warning::VacuumBehind { .. } => {
                WarningKind::VacuumOverdue
            }
            Warning::LongTransaction { .. } | Warning::InnodbTransaction { .. } => {
                WarningKind::LongTransaction
            }
            Warning::ReplicationSlot { .. } => WarningKind::ReplicationSlot,
            Warning::StandbyFeedback { .. } => WarningKind::StandbyFeedback,
            Warning::PreparedTransaction { .. } => WarningKind::PreparedTransaction,
            Warning::OldUnpublished { .. } => WarningKind::OldUnpublished,
            Warning::OldUnprocessed { .. } => WarningKind::OldUnprocessed,
            Warning::HeldKeys { .. } => WarningKind::HeldKeys,
            Warning::Parked { .. } => WarningKind::Parked,
            Warning::DeadInbox { .. } => WarningKind::DeadInbox,
            Warning::MissingTopic { .. } => WarningKind::MissingTopic,
            Warning::PartitionsNotAhead { .. } => WarningKind::PartitionsNotAhead,
            Warning::PartitionNotDropped { .. } => WarningKind::PartitionNotDropped,
            Warning::ManyPartitions { .. } => WarningKind::ManyPartitions,
            Warning::ConversionInterrupted { .. } => WarningKind::ConversionInterrupted,
            Warning::LockWait { .. } => WarningKind::LockWait,
        }
    }

    /// What the warning is about (a table, a topic, a session, a slot), with its kind: the
    /// same cause gives the same subject from one check to the next, whatever its figures.
    pub fn subject(&self) -> String {
        let what = match self {
            Warning::AutovacuumOff { table, .. } => table.clone().unwrap_or_default(),
            Warning::DeadRows { table, .. } | Warning::VacuumOverdue { table, .. } => table.clone(),
            Warning::VacuumBehind {
                table, partition, ..
            } => partition.clone().unwrap_or_else(|| table.clone()),
            Warning::LongTransaction { pid, .. } => pid.to_string(),
            Warning::InnodbTransaction { thread_id, .. } | Warning::LockWait { thread_id, .. } => {
                thread_id.to_string()
            }
            Warning::StandbyFeedback {
                application_name, ..
            } => application_name.clone(),
            Warning::MissingTopic { group, topic, .. } => format!("{group}/{topic}"),
            Warning::PartitionsNotAhead { table, .. }
            | Warning::ManyPartitions { table, .. }
            | Warning::ConversionInterrupted { table, .. } => table.clone(),
            Warning::PartitionNotDropped {
                table, partition, ..
            } => format!("{table}/{partition}"),
            Warning::ReplicationSlot { slot_name, .. } => slot_name.clone(),
            Warning::PreparedTransaction { gid, .. } => gid.clone(),
            Warning::OldUnpublished { topic, .. }
            | Warning::OldUnprocessed { topic, .. }
            | Warning::HeldKeys { topic, .. }
            | Warning::Parked { topic, .. }
            | Warning::DeadInbox { topic, .. } => topic.clone(),
        };
        format!("{}:{what}", self.kind())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_from_their_names_and_nothing_else() {
        for kind in WarningKind::ALL {
            assert_eq!(kind.as_str().parse::<WarningKind>(), Ok(kind));
            let json = serde_json::to_value(kind).unwrap();
            assert_eq!(json, kind.as_str(), "JSON spells the kind as its name");
        }
        assert_eq!(
            "autovacuum-off".parse::<WarningKind>(),
            Ok(WarningKind::AutovacuumOff)
        );
        let err = "autovacum_off".parse::<WarningKind>().unwrap_err();
        assert!(
            err.contains("unknown warning kind `autovacum_off`"),
            "{err}"
        );
        assert!(err.contains("autovacuum_off, dead_rows"), "{err}");
        let names: std::collections::BTreeSet<&str> =
            WarningKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), WarningKind::ALL.len(), "every kind named once");
    }

    #[test]
    fn a_warning_is_tagged_with_its_kind_and_its_subject_ignores_figures() {
        let w = Warning::LongTransaction {
            pid: 42,
            application_name: "psql".into(),
            user: "app".into(),
            state: "idle in transaction".into(),
            age_secs: 400.0,
        };
        let json = serde_json::to_value(&w).unwrap();
        assert_eq!(json["kind"], "long_transaction");
        assert_eq!(json["pid"], 42);
        assert_eq!(w.kind(), WarningKind::LongTransaction);
        let older = Warning::LongTransaction {
            pid: 42,
            application_name: "psql".into(),
            user: "app".into(),
            state: "active".into(),
            age_secs: 900.0,
        };
        assert_eq!(w.subject(), older.subject());
        assert_eq!(
            w.to_string(),
            "session 42 (application `psql`, user app, idle in transaction) has held a \
             transaction open for 6m40s: no dead row can be removed until it ends (SELECT \
             pg_terminate_backend(42) ends it)"
        );
    }
}
