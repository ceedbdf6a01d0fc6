//! Health warnings: what will hurt the outbox before its users notice, each naming its cause.
//!
//! [`health`] reads the backlog ([`status`](super::status)) and PostgreSQL's own statistics
//! and returns a [`Warning`] for each problem it finds: autovacuum off (for the server or a
//! table), dead rows piling up, a table not vacuumed for long, the cleanup horizon held back (a
//! long or idle-in-transaction session, a replication slot or a standby's feedback, a prepared
//! transaction), an old
//! unpublished or unprocessed row, held keys, parked rows, dead inbox rows, a consumer's missing
//! retry or dead-letter topic. `outbox status` prints them (`--check` fails while any stands)
//! and a running relay logs them and reports them as gauges.
//!
//! It needs no more privileges than the framework's own role has, with one exception: seeing
//! the sessions of *other* roles in `pg_stat_activity` needs `pg_read_all_stats` (or
//! `pg_monitor`); without it, another role's long transaction goes unnoticed.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};

use super::status::{status_on, Count, Status};
use crate::error::Result;
use crate::sqlstate::DbError;

/// Tables under this many dead rows are never reported as overdue for a vacuum: a table that
/// barely changes needs none.
pub const VACUUM_OVERDUE_MIN_DEAD_ROWS: i64 = 10_000;

/// When a figure becomes a warning, and which kinds of warning to leave out. The defaults suit
/// a service publishing hundreds to thousands of events a second; each setter says what its
/// figure means.
#[derive(Debug, Clone, PartialEq)]
#[must_use]
pub struct HealthThresholds {
    unpublished_age: Duration,
    unprocessed_age: Duration,
    dead_rows: i64,
    vacuum_age: Duration,
    transaction_age: Duration,
    idle_transaction_age: Duration,
    slot_xmin_age: i64,
    partitions_ahead: Duration,
    max_partitions: usize,
    ignored: Vec<WarningKind>,
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

    /// Warns when a table with at least [`VACUUM_OVERDUE_MIN_DEAD_ROWS`] dead rows was last
    /// vacuumed longer ago than this, or never (default 1 hour).
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

/// The kind of a [`Warning`]: its `kind` in JSON, its label on the `outbox_health_warnings`
/// gauge, and what [`HealthThresholds::ignore`] and `outbox status --ignore` take.
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
}

impl WarningKind {
    /// Every kind, in the order `outbox status` lists them.
    pub const ALL: [WarningKind; 17] = [
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

/// One problem [`health`] found, with what an operator needs to find its cause. Its `Display`
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
    /// A table holds more dead rows than [`HealthThresholds::dead_rows`].
    DeadRows {
        /// The table.
        table: String,
        /// Its dead rows (PostgreSQL's estimate).
        dead: i64,
        /// Its live rows (PostgreSQL's estimate).
        live: i64,
    },
    /// A table with dead rows was last vacuumed longer ago than
    /// [`HealthThresholds::vacuum_age`], or never.
    VacuumOverdue {
        /// The table.
        table: String,
        /// Its dead rows.
        dead: i64,
        /// Seconds since its last vacuum, by hand or automatic; `None`: never (since the
        /// statistics were last reset).
        last_vacuum_age_secs: Option<f64>,
    },
    /// A session of this database has held a transaction (or a snapshot) open longer than
    /// [`HealthThresholds::transaction_age`]: no row that became dead after it started can be
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
    /// A replication slot holds the cleanup horizon: it is inactive, or its `xmin` is more
    /// than [`HealthThresholds::slot_xmin_age`] transactions old.
    ReplicationSlot {
        /// The slot.
        slot_name: String,
        /// Whether a client is connected to it.
        active: bool,
        /// How many transactions old its `xmin` is.
        xmin_age: i64,
    },
    /// A standby's feedback (`hot_standby_feedback`, without a replication slot) holds the
    /// cleanup horizon more than [`HealthThresholds::slot_xmin_age`] transactions back: a long
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
    /// [`HealthThresholds::transaction_age`] for its `COMMIT PREPARED` or `ROLLBACK PREPARED`.
    PreparedTransaction {
        /// Its global id.
        gid: String,
        /// The role that prepared it.
        owner: String,
        /// Seconds since it was prepared.
        age_secs: f64,
    },
    /// A topic's oldest unpublished row is older than [`HealthThresholds::unpublished_age`].
    OldUnpublished {
        /// The topic.
        topic: String,
        /// The row's age in seconds.
        age_secs: f64,
    },
    /// A topic's oldest unprocessed inbox row is older than
    /// [`HealthThresholds::unprocessed_age`].
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
    /// A partitioned table's partitions reach less than [`HealthThresholds::partitions_ahead`]
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
    /// The outbox or the inbox has more partitions than [`HealthThresholds::max_partitions`]:
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
            Warning::VacuumOverdue { .. } => WarningKind::VacuumOverdue,
            Warning::LongTransaction { .. } => WarningKind::LongTransaction,
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
        }
    }

    /// What the warning is about (a table, a topic, a session, a slot), with its kind: the
    /// same cause gives the same subject from one check to the next, whatever its figures.
    pub fn subject(&self) -> String {
        let what = match self {
            Warning::AutovacuumOff { table, .. } => table.clone().unwrap_or_default(),
            Warning::DeadRows { table, .. } | Warning::VacuumOverdue { table, .. } => table.clone(),
            Warning::LongTransaction { pid, .. } => pid.to_string(),
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

/// Seconds as a short human duration: `45s`, `12m05s`, `3h20m`.
fn human(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3_599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3_600, s % 3_600 / 60),
    }
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Warning::AutovacuumOff {
                table: None,
                setting,
            } => write!(
                f,
                "autovacuum is off for the server ({setting}): dead rows of the outbox tables \
                 are never removed unless something runs VACUUM"
            ),
            Warning::AutovacuumOff {
                table: Some(table),
                setting,
            } => write!(
                f,
                "autovacuum is off for table {table} ({setting}): its dead rows are never \
                 removed unless something runs VACUUM (ALTER TABLE {table} RESET \
                 (autovacuum_enabled))"
            ),
            Warning::DeadRows { table, dead, live } => write!(
                f,
                "table {table} holds {dead} dead rows ({live} live): autovacuum is not keeping \
                 up, or something holds the cleanup horizon"
            ),
            Warning::VacuumOverdue {
                table,
                dead,
                last_vacuum_age_secs: Some(age),
            } => write!(
                f,
                "table {table} was last vacuumed {} ago and holds {dead} dead rows",
                human(*age)
            ),
            Warning::VacuumOverdue {
                table,
                dead,
                last_vacuum_age_secs: None,
            } => write!(
                f,
                "table {table} has never been vacuumed and holds {dead} dead rows"
            ),
            Warning::LongTransaction {
                pid,
                application_name,
                user,
                state,
                age_secs,
            } => write!(
                f,
                "session {pid} (application `{application_name}`, user {user}, {state}) has \
                 held a transaction open for {}: no dead row can be removed until it ends \
                 (SELECT pg_terminate_backend({pid}) ends it)",
                human(*age_secs)
            ),
            Warning::ReplicationSlot {
                slot_name,
                active,
                xmin_age,
            } => write!(
                f,
                "replication slot {slot_name} ({}) holds the cleanup horizon {xmin_age} \
                 transactions back",
                if *active { "active" } else { "inactive" }
            ),
            Warning::StandbyFeedback {
                pid,
                application_name,
                xmin_age,
            } => write!(
                f,
                "standby `{application_name}` (sender pid {pid}) holds the cleanup horizon \
                 {xmin_age} transactions back through hot_standby_feedback: a long query on \
                 the standby"
            ),
            Warning::PreparedTransaction {
                gid,
                owner,
                age_secs,
            } => write!(
                f,
                "prepared transaction `{gid}` (owner {owner}) has waited {} for COMMIT \
                 PREPARED or ROLLBACK PREPARED, holding the cleanup horizon",
                human(*age_secs)
            ),
            Warning::OldUnpublished { topic, age_secs } => write!(
                f,
                "the oldest unpublished event of `{topic}` is {} old: is a relay running and \
                 the broker reachable?",
                human(*age_secs)
            ),
            Warning::OldUnprocessed { topic, age_secs } => write!(
                f,
                "the oldest unprocessed inbox row of `{topic}` is {} old",
                human(*age_secs)
            ),
            Warning::HeldKeys {
                topic,
                rows,
                keys,
                error,
            } => {
                write!(
                    f,
                    "{keys} keys of `{topic}` are held for an operator ({rows} rows wait)"
                )?;
                match error {
                    Some(e) => write!(f, ": {e}"),
                    None => Ok(()),
                }
            }
            Warning::Parked { topic, rows } => write!(
                f,
                "`{topic}` has {rows} parked outbox rows (outbox parked list)"
            ),
            Warning::DeadInbox { topic, rows } => write!(
                f,
                "`{topic}` has {rows} dead inbox rows (outbox inbox list)"
            ),
            Warning::MissingTopic {
                group,
                topic,
                source,
                role,
                age_secs,
            } => write!(
                f,
                "consumer group `{group}` has no {} topic `{topic}` for `{source}` (missing for \
                 {}): its first message that needs it will pause every partition until it \
                 exists (outbox topics ensure creates it)",
                role.replace('_', "-"),
                human(*age_secs)
            ),
            Warning::PartitionsNotAhead {
                table,
                covered_secs,
            } => write!(
                f,
                "the partitions of {table} reach only {} past now: inserts fail once they end \
                 (is a relay or a consumer running? `outbox partitions create` makes them now)",
                human(*covered_secs)
            ),
            Warning::PartitionNotDropped {
                table,
                partition,
                reason,
            } => write!(
                f,
                "partition {partition} of {table} was not dropped: {reason} \
                 (retention tries again at its next run)"
            ),
            Warning::ManyPartitions { table, partitions } => write!(
                f,
                "{table} has {partitions} partitions, and every claim reads each of them (the \
                 more there are, the slower it publishes or processes): is retention running? \
                 (`outbox relay --retention`, `outbox cleanup`; `outbox partitions set --width` \
                 widens the partitions created from now on)"
            ),
            Warning::ConversionInterrupted {
                table,
                constraint,
                refuses_from,
                in_secs,
            } => write!(
                f,
                "converting {table} to partitions stopped midway: its constraint {constraint} \
                 refuses every insert from {refuses_from} on ({}): run `outbox partitions \
                 convert` again to finish it, or `ALTER TABLE {table} DROP CONSTRAINT \
                 {constraint}` to undo it",
                if *in_secs > 0.0 {
                    format!("in {}", human(*in_secs))
                } else {
                    "already".to_owned()
                }
            ),
        }
    }
}

/// The vacuum figures of one of the framework's tables.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct TableHealth {
    /// The table's name.
    pub table: String,
    /// Live rows (PostgreSQL's estimate).
    pub live_rows: i64,
    /// Dead rows (PostgreSQL's estimate).
    pub dead_rows: i64,
    /// Whether autovacuum may vacuum it (the table's own `autovacuum_enabled`; a partitioned
    /// table's: every partition's).
    pub autovacuum_enabled: bool,
    /// Where autovacuum is off: the table itself, or those of its partitions.
    pub autovacuum_off_in: Vec<String>,
    /// Seconds since its last vacuum, by hand or automatic; `None`: never.
    pub last_vacuum_age_secs: Option<f64>,
    /// Seconds since its last analyze, by hand or automatic; `None`: never.
    pub last_analyze_age_secs: Option<f64>,
}

/// What [`health`] reports: the backlog, the tables' vacuum figures, the oldest transaction
/// holding the cleanup horizon, and the warnings.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Health {
    /// The backlog figures, as [`status`](super::status) reads them.
    #[serde(flatten)]
    pub status: Status,
    /// Whether autovacuum runs on the server (`autovacuum` and `track_counts` on).
    pub autovacuum: bool,
    /// The framework's tables.
    pub tables: Vec<TableHealth>,
    /// Seconds since the oldest transaction of another session of this database that holds
    /// the cleanup horizon began; `None` when none does.
    pub oldest_transaction_age_secs: Option<f64>,
    /// Every standing warning not ignored, the server's first, then the tables', the
    /// horizon's, the backlog's.
    pub warnings: Vec<Warning>,
}

/// The framework's tables; a partitioned one as the sum of its partitions: their rows, and the
/// vacuum of the one that needs it most (the oldest vacuum among those with dead rows, `NULL` if
/// one of them never had one; the latest when none has dead rows). A partition never vacuumed
/// counts from its lower bound (it took no rows before; a young one is not overdue), except the
/// first, which takes everything before its upper bound.
const TABLES_SQL: &str = "\
WITH t AS ( \
    SELECT coalesce(i.inhparent, c.oid) AS parent, c.relname::text AS rel, \
           s.n_live_tup, s.n_dead_tup, \
           coalesce((SELECT option_value FROM pg_options_to_table(c.reloptions) \
                     WHERE option_name = 'autovacuum_enabled'), 'on')::bool AS autovacuum, \
           extract(epoch FROM now() - coalesce(greatest(s.last_vacuum, s.last_autovacuum), \
               CASE WHEN i.inhparent IS NOT NULL THEN substring( \
                   pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \\(''([^'']*)''\\)')::timestamptz \
               END))::float8 AS vacuum_age, \
           extract(epoch FROM now() - greatest(s.last_analyze, s.last_autoanalyze))::float8 \
               AS analyze_age \
    FROM pg_class c JOIN pg_stat_all_tables s ON s.relid = c.oid \
    LEFT JOIN pg_inherits i ON i.inhrelid = c.oid \
    WHERE c.relkind = 'r' \
      AND coalesce(i.inhparent, c.oid) IN (to_regclass('outbox_event'), \
          to_regclass('inbox_event'), to_regclass('processed_event'), \
          to_regclass('outbox_relay_waiting')) \
) \
SELECT p.relname::text AS name, sum(n_live_tup)::int8 AS live, sum(n_dead_tup)::int8 AS dead, \
       bool_and(autovacuum) AS autovacuum, \
       coalesce(array_agg(rel ORDER BY rel) FILTER (WHERE NOT autovacuum), '{}') \
           AS autovacuum_off_in, \
       CASE WHEN bool_or(n_dead_tup > 0 AND vacuum_age IS NULL) THEN NULL \
            WHEN bool_or(n_dead_tup > 0) THEN max(vacuum_age) FILTER (WHERE n_dead_tup > 0) \
            ELSE min(vacuum_age) END AS vacuum_age, \
       min(analyze_age) AS analyze_age \
FROM t JOIN pg_class p ON p.oid = t.parent \
GROUP BY p.relname ORDER BY p.relname";

/// Sessions of this database that hold the horizon of its tables: those with a transaction id
/// or a snapshot, but neither autovacuum's workers nor a plain `VACUUM` (PostgreSQL leaves
/// them out of the horizon), nor replication's senders (a standby's feedback is judged by its
/// age in transactions, [`STANDBYS_SQL`]).
const SESSIONS_SQL: &str = "\
SELECT pid, coalesce(application_name, '') AS application_name, \
       coalesce(usename::text, '') AS usename, coalesce(state, backend_type) AS state, \
       extract(epoch FROM now() - coalesce(xact_start, backend_start))::float8 AS age, \
       extract(epoch FROM now() - state_change)::float8 AS idle \
FROM pg_stat_activity \
WHERE pid <> pg_backend_pid() \
  AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) \
  AND backend_type NOT IN ('autovacuum worker', 'walsender') \
  AND datname = current_database() \
  AND NOT (state = 'active' AND query ~* '^\\s*vacuum\\y' AND query !~* '\\yfull\\y') \
ORDER BY coalesce(xact_start, backend_start)";

/// Standbys whose feedback (`hot_standby_feedback` without a slot) holds the horizon of every
/// database of the server.
const STANDBYS_SQL: &str = "\
SELECT pid, coalesce(application_name, '') AS application_name, \
       age(backend_xmin)::int8 AS xmin_age \
FROM pg_stat_replication WHERE backend_xmin IS NOT NULL ORDER BY age(backend_xmin) DESC";

const SLOTS_SQL: &str = "\
SELECT slot_name::text AS name, active, age(xmin)::int8 AS xmin_age \
FROM pg_replication_slots WHERE xmin IS NOT NULL ORDER BY age(xmin) DESC";

const PREPARED_SQL: &str = "\
SELECT gid, owner::text AS owner, extract(epoch FROM now() - prepared)::float8 AS age \
FROM pg_prepared_xacts WHERE database = current_database() ORDER BY prepared";

const MISSING_TOPICS_SQL: &str = "\
SELECT group_id, topic, source_topic, role, \
       extract(epoch FROM now() - seen_at)::float8 AS age \
FROM outbox_consumer_missing_topic ORDER BY group_id, topic";

const HELD_SQL: &str = "\
SELECT topic, count(*) AS rows, count(DISTINCT partition_key) AS keys, \
       max(last_error) AS error \
FROM outbox_event \
WHERE published_at IS NULL AND parked_at IS NULL AND held_at IS NOT NULL \
GROUP BY topic ORDER BY topic";

/// Checks the outbox's health: the backlog ([`status`](super::status)), the framework's tables'
/// vacuum figures, and whatever holds the cleanup horizon, against `thresholds`. Read-only and
/// cheap (the backlog through the partial indexes, the rest from PostgreSQL's statistics
/// views); safe to run every few seconds. The statistics views lag the tables by up to a
/// second or so.
pub async fn health(pool: &PgPool, thresholds: &HealthThresholds) -> Result<Health> {
    check(pool, thresholds, Count::Exact).await
}

/// [`health`] with `processed_event`'s rows estimated, not counted: a running relay's periodic
/// check, which must stay cheap on a large table. Public for the benchmark that compares them.
#[doc(hidden)]
pub async fn health_estimated(pool: &PgPool, thresholds: &HealthThresholds) -> Result<Health> {
    check(pool, thresholds, Count::Estimated).await
}

async fn check(pool: &PgPool, thresholds: &HealthThresholds, count: Count) -> Result<Health> {
    let mut conn = pool.acquire().await?;
    let status = status_on(&mut conn, count).await?;
    let conn = &mut *conn;
    let mut warnings = Vec::new();

    let (autovacuum, track_counts): (bool, bool) = sqlx::query_as(
        "SELECT current_setting('autovacuum')::bool, current_setting('track_counts')::bool",
    )
    .fetch_one(&mut *conn)
    .await?;
    for (on, name) in [(autovacuum, "autovacuum"), (track_counts, "track_counts")] {
        if !on {
            warnings.push(Warning::AutovacuumOff {
                table: None,
                setting: format!("{name} = off"),
            });
        }
    }

    let tables = tables(conn).await?;
    for t in &tables {
        // Named where it is set (a partition: a partitioned table has no setting of its own),
        // so that the warning's remedy is the statement to run.
        for relation in &t.autovacuum_off_in {
            warnings.push(Warning::AutovacuumOff {
                table: Some(relation.clone()),
                setting: "autovacuum_enabled = false".to_owned(),
            });
        }
        if t.dead_rows > thresholds.dead_rows {
            warnings.push(Warning::DeadRows {
                table: t.table.clone(),
                dead: t.dead_rows,
                live: t.live_rows,
            });
        }
        let overdue = t
            .last_vacuum_age_secs
            .is_none_or(|age| age > thresholds.vacuum_age.as_secs_f64());
        if t.dead_rows >= VACUUM_OVERDUE_MIN_DEAD_ROWS && overdue {
            warnings.push(Warning::VacuumOverdue {
                table: t.table.clone(),
                dead: t.dead_rows,
                last_vacuum_age_secs: t.last_vacuum_age_secs,
            });
        }
    }

    let mut oldest_transaction_age_secs = None;
    for row in sqlx::query(SESSIONS_SQL).fetch_all(&mut *conn).await? {
        let age_secs: f64 = row.try_get("age")?;
        oldest_transaction_age_secs.get_or_insert(age_secs);
        let state: String = row.try_get("state")?;
        // Idle in its transaction for that long in one stretch, not between two statements
        // of a busy one.
        let idle_secs: Option<f64> = row.try_get("idle")?;
        let idle_too_long = state.starts_with("idle in transaction")
            && idle_secs.is_some_and(|idle| {
                idle > thresholds
                    .idle_transaction_age
                    .min(thresholds.transaction_age)
                    .as_secs_f64()
            });
        if idle_too_long || age_secs > thresholds.transaction_age.as_secs_f64() {
            warnings.push(Warning::LongTransaction {
                pid: row.try_get("pid")?,
                application_name: row.try_get("application_name")?,
                user: row.try_get("usename")?,
                state,
                age_secs,
            });
        }
    }
    for row in sqlx::query(SLOTS_SQL).fetch_all(&mut *conn).await? {
        let active: bool = row.try_get("active")?;
        let xmin_age: i64 = row.try_get("xmin_age")?;
        if !active || xmin_age > thresholds.slot_xmin_age {
            warnings.push(Warning::ReplicationSlot {
                slot_name: row.try_get("name")?,
                active,
                xmin_age,
            });
        }
    }
    for row in sqlx::query(STANDBYS_SQL).fetch_all(&mut *conn).await? {
        let xmin_age: i64 = row.try_get("xmin_age")?;
        if xmin_age > thresholds.slot_xmin_age {
            warnings.push(Warning::StandbyFeedback {
                pid: row.try_get("pid")?,
                application_name: row.try_get("application_name")?,
                xmin_age,
            });
        }
    }
    for row in sqlx::query(PREPARED_SQL).fetch_all(&mut *conn).await? {
        let age_secs: f64 = row.try_get("age")?;
        if age_secs > thresholds.transaction_age.as_secs_f64() {
            warnings.push(Warning::PreparedTransaction {
                gid: row.try_get("gid")?,
                owner: row.try_get("owner")?,
                age_secs,
            });
        }
    }

    for t in &status.outbox {
        match t.oldest_unpublished_age_secs {
            Some(age) if age > thresholds.unpublished_age.as_secs_f64() => {
                warnings.push(Warning::OldUnpublished {
                    topic: t.topic.clone(),
                    age_secs: age,
                })
            }
            _ => {}
        }
    }
    for t in &status.inbox {
        match t.oldest_unprocessed_age_secs {
            Some(age) if age > thresholds.unprocessed_age.as_secs_f64() => {
                warnings.push(Warning::OldUnprocessed {
                    topic: t.topic.clone(),
                    age_secs: age,
                })
            }
            _ => {}
        }
    }
    if status.outbox.iter().any(|t| t.held > 0) {
        for row in sqlx::query(HELD_SQL).fetch_all(&mut *conn).await? {
            warnings.push(Warning::HeldKeys {
                topic: row.try_get("topic")?,
                rows: row.try_get("rows")?,
                keys: row.try_get("keys")?,
                error: row.try_get("error")?,
            });
        }
    }
    for t in status.outbox.iter().filter(|t| t.parked > 0) {
        warnings.push(Warning::Parked {
            topic: t.topic.clone(),
            rows: t.parked,
        });
    }
    for t in status.inbox.iter().filter(|t| t.dead > 0) {
        warnings.push(Warning::DeadInbox {
            topic: t.topic.clone(),
            rows: t.dead,
        });
    }

    for row in sqlx::query(MISSING_TOPICS_SQL)
        .fetch_all(&mut *conn)
        .await?
    {
        warnings.push(Warning::MissingTopic {
            group: row.try_get("group_id")?,
            topic: row.try_get("topic")?,
            source: row.try_get("source_topic")?,
            role: row.try_get("role")?,
            age_secs: row.try_get("age")?,
        });
    }

    partition_warnings(pool, thresholds, &mut warnings).await?;

    warnings.retain(|w| !thresholds.ignores(w.kind()));
    Ok(Health {
        status,
        autovacuum: autovacuum && track_counts,
        tables,
        oldest_transaction_age_secs,
        warnings,
    })
}

/// The partitioned tables' warnings: partitions not created far enough ahead, partitions
/// whose drop was interrupted, partitions retention kept past its window (an unpublished or
/// parked outbox row, an unprocessed or dead inbox row in them, as its last run found).
async fn partition_warnings(
    pool: &PgPool,
    thresholds: &HealthThresholds,
    warnings: &mut Vec<Warning>,
) -> Result<()> {
    let now: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now()").fetch_one(pool).await?;
    for table in super::CleanupTable::ALL {
        let Some(layout) = super::partitions::partitions(pool, table).await? else {
            // A plain table: a conversion stopped midway leaves its bound behind.
            let name = table.table_name();
            let bound: Option<(String, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
                r#"SELECT conname::text,
                          substring(pg_get_constraintdef(oid) FROM $$'([^']*)'$$)::timestamptz
                   FROM pg_constraint
                   WHERE conrelid = to_regclass($1) AND conname = $1 || '_before_partitions'"#,
            )
            .bind(name)
            .fetch_optional(pool)
            .await?;
            if let Some((constraint, refuses_from)) = bound {
                warnings.push(Warning::ConversionInterrupted {
                    table: name.to_owned(),
                    constraint,
                    refuses_from,
                    in_secs: (refuses_from - now).num_milliseconds() as f64 / 1000.0,
                });
            }
            continue;
        };
        let covered = layout.covered_past(now);
        if covered < thresholds.partitions_ahead.min(layout.ahead / 2) {
            warnings.push(Warning::PartitionsNotAhead {
                table: table.table_name().to_owned(),
                covered_secs: covered.as_secs_f64(),
            });
        }
        if table != super::CleanupTable::ProcessedEvent
            && layout.partitions.len() > thresholds.max_partitions
        {
            warnings.push(Warning::ManyPartitions {
                table: table.table_name().to_owned(),
                partitions: layout.partitions.len(),
            });
        }
        for p in layout.partitions.iter().filter(|p| p.detach_pending) {
            // A detach still running shows as pending too (its first transaction committed
            // the mark): only one that no session runs is interrupted.
            let running: bool = sqlx::query_scalar(
                r#"SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE state = 'active'
                     AND pid <> pg_backend_pid() AND datname = current_database()
                     AND query ~* ('detach\s+partition\s+"?' || $1 || '"?(\s|$)'))"#,
            )
            .bind(regex_escape(&p.name))
            .fetch_one(pool)
            .await?;
            if running {
                continue;
            }
            warnings.push(Warning::PartitionNotDropped {
                table: table.table_name().to_owned(),
                partition: p.name.clone(),
                reason: "its concurrent detach was interrupted".to_owned(),
            });
        }
    }
    // Before the migration that adds it, there is none (and no partitioned inbox).
    let kept: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT parent, partition, reason FROM outbox_partition_kept k \
         WHERE to_regclass(quote_ident(k.partition)) IS NOT NULL ORDER BY since, partition",
    )
    .fetch_all(pool)
    .await
    .or_else(|e| {
        if DbError::is_undefined_table(&e) {
            Ok(Vec::new())
        } else {
            Err(e)
        }
    })?;
    for (table, partition, reason) in kept {
        warnings.push(Warning::PartitionNotDropped {
            table,
            partition,
            reason: format!("{reason}, and past the window it is kept until none is left"),
        });
    }
    Ok(())
}

/// `name` as a literal in a PostgreSQL regular expression.
fn regex_escape(name: &str) -> String {
    name.chars().fold(String::new(), |mut out, c| {
        if !c.is_ascii_alphanumeric() && c != '_' {
            out.push('\\');
        }
        out.push(c);
        out
    })
}

async fn tables(conn: &mut PgConnection) -> Result<Vec<TableHealth>> {
    sqlx::query(TABLES_SQL)
        .fetch_all(conn)
        .await?
        .into_iter()
        .map(|r| {
            Ok(TableHealth {
                table: r.try_get("name")?,
                live_rows: r.try_get("live")?,
                dead_rows: r.try_get("dead")?,
                autovacuum_enabled: r.try_get("autovacuum")?,
                autovacuum_off_in: r.try_get("autovacuum_off_in")?,
                last_vacuum_age_secs: r.try_get("vacuum_age")?,
                last_analyze_age_secs: r.try_get("analyze_age")?,
            })
        })
        .collect()
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

    #[test]
    fn ignored_kinds_are_listed_once() {
        let t = HealthThresholds::default()
            .ignore(WarningKind::AutovacuumOff)
            .ignore(WarningKind::AutovacuumOff);
        assert!(t.ignores(WarningKind::AutovacuumOff));
        assert!(!t.ignores(WarningKind::Parked));
        assert_eq!(t.ignored.len(), 1);
    }

    #[test]
    fn durations_read_as_an_operator_writes_them() {
        assert_eq!(human(4.4), "4s");
        assert_eq!(human(725.0), "12m05s");
        assert_eq!(human(12_000.0), "3h20m");
    }
}
