//! A running relay's health checks: [`admin::health`](crate::admin::health) on a schedule (with
//! `processed_event`'s rows estimated, not counted; on MariaDB/MySQL `mysql::health` without
//! that figure), its warnings in the log and its figures as gauges.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sqlx::PgPool;

use super::periodic::Schedule;
use crate::admin::health::health_estimated;
#[cfg(feature = "mysql")]
use crate::admin::health::mysql_health_uncounted;
use crate::admin::{Health, HealthThresholds, WarningKind};
use crate::error::Result;

/// A standing warning is logged again this often, so the log shows it still stands.
const RELOG_EVERY: Duration = Duration::from_secs(10 * 60);

/// When the next check is due, for the relay's instances to agree on who runs it; and what the
/// checks found so far, for one check at a time.
pub(super) struct HealthChecks {
    thresholds: HealthThresholds,
    schedule: Schedule,
    state: tokio::sync::Mutex<State>,
}

/// What the checks remember from one to the next.
#[derive(Default)]
struct State {
    /// Each standing warning's subject, with when it was last logged.
    logged: HashMap<String, Instant>,
    /// Whether the last check failed (its failure is logged once).
    failing: bool,
}

impl HealthChecks {
    /// Checks every `interval` (`Duration::ZERO`: never).
    pub(super) fn new(thresholds: HealthThresholds, interval: Duration) -> HealthChecks {
        HealthChecks {
            thresholds,
            schedule: Schedule::new(interval),
            state: tokio::sync::Mutex::new(State::default()),
        }
    }

    /// Whether a check is due; the caller that gets `true` runs it, the others wait for the
    /// next one.
    pub(super) fn claim_due(&self) -> bool {
        self.schedule.claim_due()
    }

    /// Runs one check (bounded by the interval) and reports it: a warning is logged when it
    /// appears, every 10 minutes while it stands, and once when it clears; every figure is a
    /// gauge. A check that fails is logged once, until one succeeds.
    pub(super) async fn check(&self, pool: &PgPool) {
        self.check_with(health_estimated(pool, &self.thresholds))
            .await;
    }

    /// [`check`](Self::check) on MariaDB/MySQL (`processed_event` not counted).
    #[cfg(feature = "mysql")]
    pub(super) async fn check_mysql(&self, pool: &sqlx::MySqlPool) {
        self.check_with(mysql_health_uncounted(pool, &self.thresholds))
            .await;
    }

    async fn check_with(&self, find: impl std::future::Future<Output = Result<Health>>) {
        // One check at a time: while one hangs (the database away), the next ones are skipped
        // rather than queued.
        let Ok(mut state) = self.state.try_lock() else {
            return;
        };
        let State { logged, failing } = &mut *state;
        let found = tokio::time::timeout(self.schedule.every(), find).await;
        let health = match found {
            Ok(Ok(health)) => health,
            Ok(Err(e)) => {
                if !std::mem::replace(failing, true) {
                    tracing::warn!(error = %crate::error_chain(&e), "outbox health check failed; its gauges keep their last values until one succeeds");
                }
                return;
            }
            Err(_) => {
                if !std::mem::replace(failing, true) {
                    tracing::warn!(timeout = ?self.schedule.every(), "outbox health check timed out; its gauges keep their last values until one succeeds");
                }
                return;
            }
        };
        *failing = false;
        report_gauges(&health);
        let now = Instant::now();
        let mut standing = HashMap::with_capacity(health.warnings.len());
        for warning in &health.warnings {
            let subject = warning.subject();
            let last = logged.get(&subject).copied();
            if last.is_none_or(|at| now.duration_since(at) >= RELOG_EVERY) {
                tracing::warn!(kind = %warning.kind(), "outbox health: {warning}");
                standing.insert(subject, now);
            } else if let Some(at) = last {
                standing.insert(subject, at);
            }
        }
        for subject in logged.keys().filter(|s| !standing.contains_key(*s)) {
            tracing::info!(%subject, "outbox health: cleared");
        }
        *logged = standing;
    }
}

/// `outbox_health_warnings{kind}` (every kind, 0 when none stands),
/// `outbox_table_dead_rows{table}`, `outbox_autovacuum_enabled` and
/// `outbox_oldest_transaction_age_seconds`.
fn report_gauges(health: &Health) {
    for kind in WarningKind::ALL {
        let n = health.warnings.iter().filter(|w| w.kind() == kind).count();
        metrics::gauge!("outbox_health_warnings", "kind" => kind.as_str()).set(n as f64);
    }
    for t in &health.tables {
        metrics::gauge!("outbox_table_dead_rows", "table" => t.table.clone())
            .set(t.dead_rows as f64);
    }
    metrics::gauge!("outbox_autovacuum_enabled").set(if health.autovacuum { 1.0 } else { 0.0 });
    metrics::gauge!("outbox_oldest_transaction_age_seconds")
        .set(health.oldest_transaction_age_secs.unwrap_or(0.0));
}
