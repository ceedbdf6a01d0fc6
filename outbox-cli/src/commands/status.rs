//! `outbox status`: the backlog figures, as tables or JSON, and the `--max-age` health check.

use std::time::Duration;

use outbox_runtime::admin::{self, Status};

use super::{chain, connect_migrated, print_json, Result};
use crate::parse::human;
use crate::ui;
use crate::Db;

pub async fn run(db: &Db, json: bool, max_age: Option<Duration>) -> Result {
    let pool = connect_migrated(db, 2).await?;
    let status = admin::status(&pool).await.map_err(chain)?;
    if json {
        print_json(&status)?;
    } else {
        print_status(&status);
    }
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
    out!();
    out!("inbox");
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
}
