//! What a health check reports: [`Health`], and [`TableHealth`] for each table.

use serde::Serialize;

use super::warning::Warning;
use crate::admin::status::Status;

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

/// What [`health`](super::health) reports: the backlog, the tables' vacuum figures, the oldest transaction
/// holding the cleanup horizon, and the warnings.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Health {
    /// The backlog figures, as [`status`](crate::admin::status) reads them.
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
