//! What the probes' figures mean: each function here turns one probe's results into the
//! warnings they call for, against the thresholds. No I/O.

use chrono::{DateTime, Utc};

use super::probes::{
    Held, Layout, MissingTopic, Prepared, Relation, Session, Since, Slot, Standby,
};
use super::report::TableHealth;
use super::thresholds::{HealthThresholds, VACUUM_OVERDUE_MIN_DEAD_ROWS};
use super::warning::Warning;
use crate::admin::status::Status;
use crate::admin::CleanupTable;

/// Autovacuum or the statistics it works from off for the whole server.
pub(super) fn server(autovacuum: bool, track_counts: bool) -> Vec<Warning> {
    let mut warnings = Vec::new();
    for (on, name) in [(autovacuum, "autovacuum"), (track_counts, "track_counts")] {
        if !on {
            warnings.push(Warning::AutovacuumOff {
                table: None,
                setting: format!("{name} = off"),
            });
        }
    }
    warnings
}

/// Each table's: autovacuum off where it is set, dead rows piling up.
pub(super) fn tables(tables: &[TableHealth], thresholds: &HealthThresholds) -> Vec<Warning> {
    let mut warnings = Vec::new();
    for t in tables {
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
    }
    warnings
}

/// The tables and partitions autovacuum is not keeping up with: at least
/// [`VACUUM_OVERDUE_MIN_DEAD_ROWS`] dead rows, past autovacuum's own trigger for the table (or
/// autovacuum cannot vacuum it: `server` off, or the table's own setting), no vacuum running on
/// it, and none for longer than the threshold: since its last one, or, never vacuumed, since it
/// could first hold rows (the latest of the installation, its lower bound and the statistics'
/// reset). A partition created minutes ago, whatever its lower bound, is not behind.
pub(super) fn vacuums(
    relations: Vec<Relation>,
    since: &Since,
    server: bool,
    thresholds: &HealthThresholds,
) -> Vec<Warning> {
    let secs = |at: DateTime<Utc>| (since.now - at).num_milliseconds() as f64 / 1000.0;
    let mut warnings = Vec::new();
    for r in relations {
        if r.dead < VACUUM_OVERDUE_MIN_DEAD_ROWS || r.vacuuming {
            continue;
        }
        // autovacuum vacuums a table once its dead rows pass this (relation_needs_vacanalyze).
        let autovacuum_at = (server && r.autovacuum)
            .then(|| (r.threshold + r.scale_factor * r.reltuples).floor() as i64);
        if autovacuum_at.is_some_and(|at| r.dead <= at) {
            continue;
        }
        let last_vacuum_age_secs = r.last_vacuum.map(secs);
        let rows_age_secs = [since.installed, r.lower_bound, since.stats_reset]
            .into_iter()
            .flatten()
            .max()
            .map(secs);
        let behind_for = last_vacuum_age_secs.or(rows_age_secs);
        if behind_for.is_some_and(|age| age <= thresholds.vacuum_age.as_secs_f64()) {
            continue;
        }
        warnings.push(Warning::VacuumBehind {
            table: r.table,
            partition: r.partition,
            dead: r.dead,
            autovacuum_at,
            last_vacuum_age_secs,
            rows_age_secs,
        });
    }
    warnings
}

/// Sessions that have held the horizon too long, or sat idle in their transaction too long.
pub(super) fn sessions(sessions: Vec<Session>, thresholds: &HealthThresholds) -> Vec<Warning> {
    let mut warnings = Vec::new();
    for s in sessions {
        let idle = s
            .idle_secs
            .filter(|_| s.state.starts_with("idle in transaction"));
        if held_too_long(s.age_secs, idle, thresholds) {
            warnings.push(Warning::LongTransaction {
                pid: s.pid,
                application_name: s.application_name,
                user: s.user,
                state: s.state,
                age_secs: s.age_secs,
            });
        }
    }
    warnings
}

/// Whether a transaction `age_secs` old has been open too long, or (`idle_secs`: how long it
/// has sat idle in one stretch, when it is idle, not between two statements of a busy one)
/// idle in it too long; PostgreSQL's sessions and InnoDB's transactions alike.
pub(super) fn held_too_long(
    age_secs: f64,
    idle_secs: Option<f64>,
    thresholds: &HealthThresholds,
) -> bool {
    let idle_limit = thresholds
        .idle_transaction_age
        .min(thresholds.transaction_age)
        .as_secs_f64();
    idle_secs.is_some_and(|idle| idle > idle_limit)
        || age_secs > thresholds.transaction_age.as_secs_f64()
}

/// Replication slots that hold the horizon: inactive, or too far back.
pub(super) fn slots(slots: Vec<Slot>, thresholds: &HealthThresholds) -> Vec<Warning> {
    slots
        .into_iter()
        .filter(|s| !s.active || s.xmin_age > thresholds.slot_xmin_age)
        .map(|s| Warning::ReplicationSlot {
            slot_name: s.name,
            active: s.active,
            xmin_age: s.xmin_age,
        })
        .collect()
}

/// Standbys whose feedback holds the horizon too far back.
pub(super) fn standbys(standbys: Vec<Standby>, thresholds: &HealthThresholds) -> Vec<Warning> {
    standbys
        .into_iter()
        .filter(|s| s.xmin_age > thresholds.slot_xmin_age)
        .map(|s| Warning::StandbyFeedback {
            pid: s.pid,
            application_name: s.application_name,
            xmin_age: s.xmin_age,
        })
        .collect()
}

/// Prepared transactions waiting too long for their end.
pub(super) fn prepared(prepared: Vec<Prepared>, thresholds: &HealthThresholds) -> Vec<Warning> {
    prepared
        .into_iter()
        .filter(|p| p.age_secs > thresholds.transaction_age.as_secs_f64())
        .map(|p| Warning::PreparedTransaction {
            gid: p.gid,
            owner: p.owner,
            age_secs: p.age_secs,
        })
        .collect()
}

/// The backlog's: old unpublished and unprocessed rows, held keys, parked and dead rows.
pub(super) fn backlog(
    status: &Status,
    held: Vec<Held>,
    thresholds: &HealthThresholds,
) -> Vec<Warning> {
    let mut warnings = Vec::new();
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
    for h in held {
        warnings.push(Warning::HeldKeys {
            topic: h.topic,
            rows: h.rows,
            keys: h.keys,
            error: h.error,
        });
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
    warnings
}

/// Each retry or dead-letter topic a consumer group found missing.
pub(super) fn missing_topics(missing: Vec<MissingTopic>) -> Vec<Warning> {
    missing
        .into_iter()
        .map(|m| Warning::MissingTopic {
            group: m.group,
            topic: m.topic,
            source: m.source,
            role: m.role,
            age_secs: m.age_secs,
        })
        .collect()
}

/// The partitioned tables' warnings: partitions not created far enough ahead, too many of
/// them, partitions whose drop was interrupted, partitions retention kept past its window (an
/// unpublished or parked outbox row, an unprocessed or dead inbox row in them, as its last run
/// found); and a plain table whose conversion stopped midway.
pub(super) fn partitions(
    now: DateTime<Utc>,
    layouts: Vec<Layout>,
    kept: Vec<(String, String, String)>,
    thresholds: &HealthThresholds,
) -> Vec<Warning> {
    let mut warnings = Vec::new();
    for layout in layouts {
        let (layout, interrupted) = match layout {
            Layout::Plain { table, bound } => {
                if let Some((constraint, refuses_from)) = bound {
                    warnings.push(Warning::ConversionInterrupted {
                        table: table.table_name().to_owned(),
                        constraint,
                        refuses_from,
                        in_secs: (refuses_from - now).num_milliseconds() as f64 / 1000.0,
                    });
                }
                continue;
            }
            Layout::Partitioned {
                layout,
                interrupted,
            } => (layout, interrupted),
        };
        let table = layout.table;
        let covered = layout.covered_past(now);
        if covered < thresholds.partitions_ahead.min(layout.ahead / 2) {
            warnings.push(Warning::PartitionsNotAhead {
                table: table.table_name().to_owned(),
                covered_secs: covered.as_secs_f64(),
            });
        }
        if table != CleanupTable::ProcessedEvent
            && layout.partitions.len() > thresholds.max_partitions
        {
            warnings.push(Warning::ManyPartitions {
                table: table.table_name().to_owned(),
                partitions: layout.partitions.len(),
            });
        }
        for partition in interrupted {
            warnings.push(Warning::PartitionNotDropped {
                table: table.table_name().to_owned(),
                partition,
                reason: "its concurrent detach was interrupted".to_owned(),
            });
        }
    }
    for (table, partition, reason) in kept {
        warnings.push(Warning::PartitionNotDropped {
            table,
            partition,
            reason: format!("{reason}, and past the window it is kept until none is left"),
        });
    }
    warnings
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(minutes_ago: i64) -> DateTime<Utc> {
        now() - chrono::Duration::minutes(minutes_ago)
    }

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-12-04T14:36:00Z")
            .unwrap()
            .with_timezone(&Utc)
    }

    /// Today's partition of a new installation's outbox (it opened at midnight), 41,448 rows
    /// dead, never vacuumed, with the server's autovacuum settings (50 + 20%).
    fn partition(last_vacuum: Option<DateTime<Utc>>, reltuples: f64) -> Relation {
        Relation {
            table: "outbox_event".into(),
            partition: Some("outbox_event_20261204".into()),
            dead: 41_448,
            reltuples,
            autovacuum: true,
            threshold: 50.0,
            scale_factor: 0.2,
            last_vacuum,
            lower_bound: Some(at(14 * 60 + 36)),
            vacuuming: false,
        }
    }

    fn installed(minutes_ago: i64) -> Since {
        Since {
            now: now(),
            installed: Some(at(minutes_ago)),
            stats_reset: None,
        }
    }

    #[test]
    fn a_partition_of_a_minute_old_installation_is_not_behind_whatever_its_lower_bound() {
        let t = HealthThresholds::default();
        let fresh = vacuums(vec![partition(None, 0.0)], &installed(1), true, &t);
        assert_eq!(fresh, []);
        // Two hours on, still never vacuumed though autovacuum would have: behind, and said
        // so as never vacuumed, two hours at most.
        let old = vacuums(vec![partition(None, 0.0)], &installed(120), true, &t);
        match &old[..] {
            [Warning::VacuumBehind {
                last_vacuum_age_secs: None,
                rows_age_secs: Some(age),
                autovacuum_at: Some(50),
                ..
            }] => assert_eq!(*age, 7200.0),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn below_autovacuums_trigger_or_vacuumed_lately_is_not_behind() {
        let t = HealthThresholds::default();
        // 41,448 dead rows of 1,000,000: under autovacuum's 200,050.
        let big = vacuums(vec![partition(None, 1e6)], &installed(600), true, &t);
        assert_eq!(big, []);
        let lately = vacuums(
            vec![partition(Some(at(20)), 0.0)],
            &installed(600),
            true,
            &t,
        );
        assert_eq!(lately, []);
        // Autovacuum off: whatever the trigger, behind once the threshold has passed.
        let off = vacuums(
            vec![partition(Some(at(90)), 1e6)],
            &installed(600),
            false,
            &t,
        );
        assert!(matches!(
            &off[..],
            [Warning::VacuumBehind {
                autovacuum_at: None,
                ..
            }]
        ));
        // A vacuum running on it: it is being dealt with.
        let mut running = partition(None, 0.0);
        running.vacuuming = true;
        assert_eq!(vacuums(vec![running], &installed(600), true, &t), []);
    }
}
