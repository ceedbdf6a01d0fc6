//! A [`Warning`] as one line that names its cause and what to do.

use std::fmt;

use super::warning::Warning;

/// Seconds as a short human duration: `45s`, `12m05s`, `3h20m`.
fn human(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3_599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3_600, s % 3_600 / 60),
    }
}

/// `41,448`.
fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 1);
    if n < 0 {
        out.push('-');
    }
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `1 row`, `41,448 rows`: a figure and its noun, agreeing.
fn count(n: i64, one: &str, many: &str) -> String {
    format!("{} {}", thousands(n), if n == 1 { one } else { many })
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
                "table {table} holds {} ({} live): autovacuum is not keeping up, or \
                 something holds the cleanup horizon",
                count(*dead, "dead row", "dead rows"),
                thousands(*live)
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
            Warning::VacuumBehind {
                table,
                partition,
                dead,
                autovacuum_at,
                last_vacuum_age_secs,
                rows_age_secs,
            } => {
                let what = match partition {
                    Some(p) => format!("partition {p} of {table}"),
                    None => format!("table {table}"),
                };
                let dead = count(*dead, "dead row", "dead rows");
                match (last_vacuum_age_secs, rows_age_secs) {
                    (Some(age), _) => write!(
                        f,
                        "{what} was last vacuumed {} ago and holds {dead}",
                        human(*age)
                    )?,
                    (None, Some(rows)) => write!(
                        f,
                        "{what} has never been vacuumed in the {} it can have held rows, and \
                         holds {dead}",
                        human(*rows)
                    )?,
                    (None, None) => write!(f, "{what} has never been vacuumed and holds {dead}")?,
                }
                match autovacuum_at {
                    Some(at) => write!(
                        f,
                        ", past the {} at which autovacuum vacuums it: autovacuum is not keeping \
                         up (its workers busy with other tables, or autovacuum_naptime long)",
                        thousands(*at)
                    ),
                    None => write!(
                        f,
                        ": autovacuum cannot vacuum it (off), and nothing else did (VACUUM {} \
                         does)",
                        partition.as_deref().unwrap_or(table)
                    ),
                }
            }
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
            Warning::InnodbTransaction {
                thread_id,
                host,
                user,
                command,
                age_secs,
                history_list_length,
            } => {
                write!(
                    f,
                    "connection {thread_id} (host `{host}`, user {user}, {command}) has held a \
                     transaction open for {}: InnoDB cannot purge what changed since",
                    human(*age_secs)
                )?;
                if let Some(length) = history_list_length {
                    write!(f, " (history list length {length})")?;
                }
                write!(f, " (KILL {thread_id} ends it)")
            }
            Warning::LockWait {
                thread_id,
                host,
                user,
                waited_secs,
                blocking_thread_id,
            } => {
                write!(
                    f,
                    "connection {thread_id} (host `{host}`, user {user}) has waited {} for a \
                     row lock",
                    human(*waited_secs)
                )?;
                match blocking_thread_id {
                    Some(b) => write!(
                        f,
                        " held by connection {b}'s transaction (KILL {b} ends it)"
                    ),
                    None => write!(f, " (INNODB_TRX shows who holds it)"),
                }
            }
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
                    "{} of `{topic}` {} held for an operator ({} wait{})",
                    count(*keys, "key", "keys"),
                    if *keys == 1 { "is" } else { "are" },
                    count(*rows, "row", "rows"),
                    if *rows == 1 { "s" } else { "" }
                )?;
                match error {
                    Some(e) => write!(f, ": {e}"),
                    None => Ok(()),
                }
            }
            Warning::Parked { topic, rows } => write!(
                f,
                "`{topic}` has {} (outbox parked list)",
                count(*rows, "parked outbox row", "parked outbox rows")
            ),
            Warning::DeadInbox { topic, rows } => write!(
                f,
                "`{topic}` has {} (outbox inbox list)",
                count(*rows, "dead inbox row", "dead inbox rows")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_an_operator_writes_them() {
        assert_eq!(human(4.4), "4s");
        assert_eq!(human(725.0), "12m05s");
        assert_eq!(human(12_000.0), "3h20m");
    }

    #[test]
    fn figures_agree_with_their_nouns() {
        let parked = |rows| Warning::Parked {
            topic: "t".into(),
            rows,
        };
        assert_eq!(
            parked(1).to_string(),
            "`t` has 1 parked outbox row (outbox parked list)"
        );
        assert_eq!(
            parked(2).to_string(),
            "`t` has 2 parked outbox rows (outbox parked list)"
        );
        let held = Warning::HeldKeys {
            topic: "t".into(),
            rows: 1,
            keys: 1,
            error: None,
        };
        assert_eq!(
            held.to_string(),
            "1 key of `t` is held for an operator (1 row waits)"
        );
    }

    #[test]
    fn a_vacuum_behind_says_never_when_never_and_how_old_the_table_can_be() {
        let behind = |last, rows, at| Warning::VacuumBehind {
            table: "outbox_event".into(),
            partition: Some("outbox_event_20261204".into()),
            dead: 41_448,
            autovacuum_at: at,
            last_vacuum_age_secs: last,
            rows_age_secs: rows,
        };
        assert_eq!(
            behind(None, Some(7_500.0), Some(5_050)).to_string(),
            "partition outbox_event_20261204 of outbox_event has never been vacuumed in the \
             2h05m it can have held rows, and holds 41,448 dead rows, past the 5,050 at which \
             autovacuum vacuums it: autovacuum is not keeping up (its workers busy with other \
             tables, or autovacuum_naptime long)"
        );
        assert_eq!(
            behind(Some(5_400.0), Some(86_400.0), None).to_string(),
            "partition outbox_event_20261204 of outbox_event was last vacuumed 1h30m ago and \
             holds 41,448 dead rows: autovacuum cannot vacuum it (off), and nothing else did \
             (VACUUM outbox_event_20261204 does)"
        );
    }
}
