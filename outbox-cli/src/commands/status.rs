//! `outbox status`: the backlog figures, the tables' vacuum figures and the health warnings, as
//! tables or JSON, and the `--check` and `--max-age` health checks.

use std::time::Duration;

use outbox_runtime::admin::{self, Health, HealthThresholds, Status};
use outbox_runtime::rabbitmq::QueueReport;

use super::{chain, connect_migrated, connect_mysql_migrated, is_mysql, print_json, Result};
use crate::args::{Db, Queues};
use crate::parse::human;
use crate::ui;

pub async fn run(
    db: &Db,
    json: bool,
    check: bool,
    thresholds: &HealthThresholds,
    max_age: Option<Duration>,
    queues: &Queues,
) -> Result {
    if is_mysql(&db.database_url) {
        return run_mysql(db, json, check, thresholds, max_age, queues).await;
    }
    let pool = connect_migrated(db, 2).await?;
    let health = admin::health(&pool, thresholds).await.map_err(chain)?;
    let rabbitmq = match queues.settings() {
        Some(settings) => Some(rabbitmq_queues(&settings, queues, &health.status).await?),
        None => None,
    };
    if json {
        match &rabbitmq {
            None => print_json(&health)?,
            Some(rows) => {
                let mut value = serde_json::to_value(&health).map_err(|e| e.to_string())?;
                value["rabbitmq_queues"] = serde_json::to_value(rows).map_err(|e| e.to_string())?;
                print_json(&value)?;
            }
        }
    } else {
        print_status(&health.status);
        if let Some(rows) = &rabbitmq {
            print_queues(queues, rows);
        }
        print_health(&health);
    }
    if check {
        check_warnings(&health)?;
    }
    check_max_age(&health.status, max_age)
}

/// `--check`: no health warning stands.
fn check_warnings(health: &Health) -> Result {
    if health.warnings.is_empty() {
        return Ok(());
    }
    let mut kinds: Vec<&str> = Vec::new();
    for kind in health.warnings.iter().map(|w| w.kind().as_str()) {
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    Err(format!(
        "{} health warning(s) stand ({}); the first: {}",
        health.warnings.len(),
        kinds.join(", "),
        health.warnings[0]
    ))
}

/// `outbox status` for a `mysql://` URL: the outbox's figures, the relay instances and the
/// warnings that apply there (the inbox and the queues are not built for MariaDB/MySQL yet).
async fn run_mysql(
    db: &Db,
    json: bool,
    check: bool,
    thresholds: &HealthThresholds,
    max_age: Option<Duration>,
    queues: &Queues,
) -> Result {
    if queues.settings().is_some() {
        return Err("the RabbitMQ queues' figures are not built for MariaDB/MySQL yet".into());
    }
    let pool = connect_mysql_migrated(db, 2).await?;
    let health = outbox_runtime::mysql::health(&pool, thresholds)
        .await
        .map_err(chain)?;
    if json {
        print_json(&health)?;
    } else {
        print_outbox(&health.status);
        print_warnings(&health);
    }
    if check {
        check_warnings(&health)?;
    }
    check_max_age(&health.status, max_age)
}

/// `--max-age`: the oldest unpublished (or unprocessed) row is younger than `max_age`.
fn check_max_age(status: &Status, max_age: Option<Duration>) -> Result {
    let Some(max_age) = max_age else {
        return Ok(());
    };
    let outbox = status.outbox.iter().filter_map(|t| {
        Some((
            t.oldest_unpublished_age_secs?,
            "unpublished outbox",
            &t.topic,
        ))
    });
    let inbox = status.inbox.iter().filter_map(|t| {
        Some((
            t.oldest_unprocessed_age_secs?,
            "unprocessed inbox",
            &t.topic,
        ))
    });
    let oldest = outbox.chain(inbox).max_by(|a, b| a.0.total_cmp(&b.0));
    match oldest {
        Some((age, what, topic)) if age > max_age.as_secs_f64() => Err(format!(
            "the oldest {what} row of `{topic}` is {} old, more than {}",
            human(Duration::from_secs_f64(age)),
            human(max_age)
        )),
        _ => Ok(()),
    }
}

fn age(secs: Option<f64>) -> String {
    secs.map_or_else(
        || "-".to_owned(),
        |s| human(Duration::from_secs_f64(s.max(0.0))),
    )
}

fn print_status(status: &Status) {
    print_outbox(status);
    print_inbox(status);
}

fn print_outbox(status: &Status) {
    out!(
        "outbox ({} relay instances running)",
        status.relay_instances
    );
    if status.outbox.is_empty() {
        out!("  nothing unpublished or parked, nothing published in the last minute");
    } else {
        let rows: Vec<Vec<String>> = status
            .outbox
            .iter()
            .map(|t| {
                vec![
                    t.topic.clone(),
                    t.unpublished.to_string(),
                    t.retrying.to_string(),
                    t.held.to_string(),
                    t.parked.to_string(),
                    age(t.oldest_unpublished_age_secs),
                    t.published_last_minute.to_string(),
                ]
            })
            .collect();
        ui::table(
            &[
                "TOPIC",
                "UNPUBLISHED",
                "RETRYING",
                "HELD",
                "PARKED",
                "OLDEST",
                "PUBLISHED/1M",
            ],
            &[false, true, true, true, true, true, true],
            &rows,
        );
    }
}

fn print_inbox(status: &Status) {
    out!();
    out!(
        "inbox ({} inbox processors running)",
        status.inbox_processors
    );
    if status.inbox.is_empty() {
        out!("  nothing unprocessed or dead");
    } else {
        let rows: Vec<Vec<String>> = status
            .inbox
            .iter()
            .map(|t| {
                vec![
                    t.topic.clone(),
                    t.unprocessed.to_string(),
                    t.retrying.to_string(),
                    t.dead.to_string(),
                    age(t.oldest_unprocessed_age_secs),
                ]
            })
            .collect();
        ui::table(
            &["TOPIC", "UNPROCESSED", "RETRYING", "DEAD", "OLDEST"],
            &[false, true, true, true, true],
            &rows,
        );
    }
    out!();
    out!("processed_event rows: {}", status.processed_event_rows);
    if !status.consumer_leases.is_empty() {
        out!();
        out!("JetStream consumers (one instance of a group reads a topic)");
        let rows: Vec<Vec<String>> = status
            .consumer_leases
            .iter()
            .map(|l| {
                let state = match l.expires_in_secs {
                    None => "released".to_owned(),
                    Some(s) if l.owned => format!("owned, {s:.0}s left"),
                    Some(s) => format!("expired {:.0}s ago", -s),
                };
                vec![l.group.clone(), l.topic.clone(), state]
            })
            .collect();
        ui::table(&["GROUP", "TOPIC", "LEASE"], &[false, false, false], &rows);
    }
}

fn print_health(health: &Health) {
    out!();
    out!(
        "tables (autovacuum {} for the server)",
        if health.autovacuum { "on" } else { "off" }
    );
    let rows: Vec<Vec<String>> = health
        .tables
        .iter()
        .map(|t| {
            vec![
                t.table.clone(),
                t.live_rows.to_string(),
                t.dead_rows.to_string(),
                if t.autovacuum_enabled { "on" } else { "off" }.to_owned(),
                t.last_vacuum_age_secs
                    .map_or_else(|| "never".to_owned(), |s| age(Some(s))),
                t.last_analyze_age_secs
                    .map_or_else(|| "never".to_owned(), |s| age(Some(s))),
            ]
        })
        .collect();
    ui::table(
        &[
            "TABLE",
            "LIVE",
            "DEAD",
            "AUTOVACUUM",
            "LAST VACUUM",
            "LAST ANALYZE",
        ],
        &[false, true, true, false, true, true],
        &rows,
    );
    if let Some(secs) = health.oldest_transaction_age_secs {
        out!(
            "oldest transaction holding the cleanup horizon: {}",
            age(Some(secs))
        );
    }
    print_warnings(health);
}

fn print_warnings(health: &Health) {
    out!();
    if health.warnings.is_empty() {
        out!("health: no warnings");
    } else {
        out!("health: {} warning(s)", health.warnings.len());
        for warning in &health.warnings {
            out!("  ! {warning}");
        }
    }
}

/// The queues of each group for the topics --topic names, or else every topic of the status.
async fn rabbitmq_queues(
    settings: &outbox_runtime::rabbitmq::RabbitMq,
    queues: &Queues,
    status: &Status,
) -> Result<Vec<QueueReport>> {
    let mut topics = queues.topics.clone();
    if topics.is_empty() {
        topics = status.topics();
    }
    settings
        .queues(&topics, &queues.groups)
        .await
        .map_err(chain)
}

fn print_queues(queues: &Queues, rows: &[QueueReport]) {
    out!();
    out!(
        "RabbitMQ queues ({}, {} shards)",
        queues
            .settings()
            .map_or_else(String::new, |s| s.url_for_display()),
        queues.shards
    );
    if rows.is_empty() {
        out!("  no topics to report: name them with --topic");
        return;
    }
    let number = |n: Option<u32>| n.map_or_else(|| "-".to_owned(), |n| n.to_string());
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let state = r.state();
            vec![
                r.topic.clone(),
                r.group.clone(),
                r.queue.clone(),
                r.kind.label().to_owned(),
                number(r.messages),
                number(r.consumers),
                state.to_owned(),
            ]
        })
        .collect();
    ui::table(
        &[
            "TOPIC",
            "GROUP",
            "QUEUE",
            "KIND",
            "READY",
            "CONSUMERS",
            "STATE",
        ],
        &[false, false, false, false, true, true, false],
        &table,
    );
}
