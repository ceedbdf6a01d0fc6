//! What the probes' figures mean: each function here turns one probe's results into the
//! warnings they call for, against the thresholds. No I/O.

use chrono::{DateTime, Utc};

use super::probes::{Held, Layout, MissingTopic, Prepared, Session, Slot, Standby};
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

/// Each table's: autovacuum off where it is set, dead rows piling up, a vacuum overdue.
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
    warnings
}

/// Sessions that have held the horizon too long, or sat idle in their transaction too long.
pub(super) fn sessions(sessions: Vec<Session>, thresholds: &HealthThresholds) -> Vec<Warning> {
    let mut warnings = Vec::new();
    for s in sessions {
        // Idle in its transaction for that long in one stretch, not between two statements
        // of a busy one.
        let idle_too_long = s.state.starts_with("idle in transaction")
            && s.idle_secs.is_some_and(|idle| {
                idle > thresholds
                    .idle_transaction_age
                    .min(thresholds.transaction_age)
                    .as_secs_f64()
            });
        if idle_too_long || s.age_secs > thresholds.transaction_age.as_secs_f64() {
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
