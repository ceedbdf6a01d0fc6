//! Health warnings: what will hurt the outbox before its users notice, each naming its cause.
//!
//! [`health`] reads the backlog ([`status`](super::status)) and PostgreSQL's own statistics
//! and returns a [`Warning`] for each problem it finds: autovacuum off (for the server or a
//! table), dead rows piling up, a table (a partition) autovacuum is not keeping up with (said
//! as it is: never vacuumed, or last vacuumed when; how long it can have held rows), the
//! cleanup horizon held back (a
//! long or idle-in-transaction session, a replication slot or a standby's feedback, a prepared
//! transaction), an old
//! unpublished or unprocessed row, held keys, parked rows, dead inbox rows, a consumer's missing
//! retry or dead-letter topic. `outbox status` prints them (`--check` fails while any stands)
//! and a running relay logs them and reports them as gauges.
//!
//! It needs no more privileges than the framework's own role has, with one exception: seeing
//! the sessions of *other* roles in `pg_stat_activity` needs `pg_read_all_stats` (or
//! `pg_monitor`); without it, another role's long transaction goes unnoticed.
//!
//! The check reads its figures through the probes (`probes.rs`), and `assess.rs` turns them
//! into warnings against the thresholds (`thresholds.rs`); `warning.rs` and `display.rs` are
//! the warnings and their text, `report.rs` what the check returns.

mod assess;
mod display;
#[cfg(feature = "mysql")]
mod mysql;
mod probes;
mod report;
mod thresholds;
mod warning;

use sqlx::PgPool;

#[cfg(feature = "mysql")]
pub use mysql::health as mysql_health;
#[cfg(all(feature = "mysql", feature = "_broker"))]
pub(crate) use mysql::health_uncounted as mysql_health_uncounted;
pub use report::{Health, TableHealth};
pub use thresholds::{HealthThresholds, VACUUM_OVERDUE_MIN_DEAD_ROWS};
pub use warning::{Warning, WarningKind};

use super::status::{status_on, Count};
use crate::error::Result;

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
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // a test hook too
pub async fn health_estimated(pool: &PgPool, thresholds: &HealthThresholds) -> Result<Health> {
    check(pool, thresholds, Count::Estimated).await
}

/// One check: the backlog, then each probe in turn on one connection, each followed by the
/// warnings it calls for (the partitions' last, on the pool's connections); the ignored kinds
/// left out.
async fn check(pool: &PgPool, thresholds: &HealthThresholds, count: Count) -> Result<Health> {
    let mut conn = pool.acquire().await?;
    let status = status_on(&mut conn, count).await?;
    let conn = &mut *conn;

    let (autovacuum, track_counts) = probes::autovacuum(conn).await?;
    let mut warnings = assess::server(autovacuum, track_counts);

    let tables = probes::tables(conn).await?;
    warnings.extend(assess::tables(&tables, thresholds));
    let relations = probes::relations(conn, VACUUM_OVERDUE_MIN_DEAD_ROWS).await?;
    let since = probes::since(conn).await?;
    warnings.extend(assess::vacuums(
        relations,
        &since,
        autovacuum && track_counts,
        thresholds,
    ));

    // What holds the cleanup horizon.
    let sessions = probes::sessions(conn).await?;
    let oldest_transaction_age_secs = sessions.first().map(|s| s.age_secs);
    warnings.extend(assess::sessions(sessions, thresholds));
    warnings.extend(assess::slots(probes::slots(conn).await?, thresholds));
    warnings.extend(assess::standbys(probes::standbys(conn).await?, thresholds));
    warnings.extend(assess::prepared(probes::prepared(conn).await?, thresholds));

    // The backlog's; held keys are looked up only when the backlog counts some.
    let held = if status.outbox.iter().any(|t| t.held > 0) {
        probes::held_keys(conn).await?
    } else {
        Vec::new()
    };
    warnings.extend(assess::backlog(&status, held, thresholds));
    warnings.extend(assess::missing_topics(probes::missing_topics(conn).await?));

    let now = probes::now(pool).await?;
    let layouts = probes::layouts(pool).await?;
    let kept = probes::kept_partitions(pool).await?;
    warnings.extend(assess::partitions(now, layouts, kept, thresholds));

    warnings.retain(|w| !thresholds.ignores(w.kind()));
    Ok(Health {
        status,
        autovacuum: autovacuum && track_counts,
        tables,
        oldest_transaction_age_secs,
        warnings,
    })
}
