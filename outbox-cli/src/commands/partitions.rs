//! `outbox partitions`: the time partitions of processed_event, inbox_event and outbox_event.

use outbox_runtime::admin::{self, Conversion, PartitionLayout};

use super::{chain, connect_migrated, print_json, Result};
use crate::args::PartitionsAction;
use crate::{parse, ui};

pub async fn run(action: PartitionsAction) -> Result {
    match action {
        PartitionsAction::List { db, table, json } => {
            let (table, name) = (table.table, table.table.table_name());
            let pool = connect_migrated(&db, 2).await?;
            let layout = admin::partitions(&pool, table).await.map_err(chain)?;
            if json {
                return print_json(&layout);
            }
            match layout {
                Some(layout) => list(&layout),
                None => out!(
                    "{name} is not partitioned (an installation from before partitions): \
                     `outbox partitions convert --table {}` converts it in place",
                    name.trim_end_matches("_event")
                ),
            }
            Ok(())
        }
        PartitionsAction::Create { db, table } => {
            let (table, name) = (table.table, table.table.table_name());
            let pool = connect_migrated(&db, 2).await?;
            let created = admin::create_partitions(&pool, table)
                .await
                .map_err(chain)?;
            out!("created {created} partitions of {name}");
            Ok(())
        }
        PartitionsAction::Set {
            db,
            table,
            width,
            ahead,
        } => {
            let (table, name) = (table.table, table.table.table_name());
            let pool = connect_migrated(&db, 2).await?;
            let created = admin::set_partitioning(&pool, table, width, ahead)
                .await
                .map_err(chain)?;
            out!(
                "{name}: partitions {} wide from the last one on, kept {} ahead; \
                 created {created}",
                parse::human(width),
                parse::human(ahead)
            );
            Ok(())
        }
        PartitionsAction::Convert { db, table, yes } => {
            let (table, name) = (table.table, table.table.table_name());
            let pool = connect_migrated(&db, 4).await?;
            if admin::partitions(&pool, table)
                .await
                .map_err(chain)?
                .is_some()
            {
                out!("{name} is partitioned already");
                return Ok(());
            }
            use outbox_runtime::admin::CleanupTable;
            let first = match table {
                CleanupTable::Outbox => {
                    "every relay and cleanup job must run this version or later (older ones \
                     drop outbox partitions without checking their rows), and every relay must \
                     be stopped first, and started again after (the conversion refuses while \
                     one runs); emitters may go on"
                }
                CleanupTable::Inbox => {
                    "consumers, relays with retention and cleanup jobs of an older version \
                     must be stopped first: older consumers cannot insert into the \
                     partitioned inbox, older retention drops its partitions without checking \
                     their rows"
                }
                CleanupTable::ProcessedEvent => {
                    "consumers of an older version must be stopped first: they do not \
                     deduplicate against the partitioned table"
                }
            };
            ui::confirm(
                &format!("convert {name} to partitions in place ({first})"),
                yes,
            )?;
            match admin::convert_to_partitions(&pool, table)
                .await
                .map_err(chain)?
            {
                Conversion::Converted {
                    history,
                    history_until,
                    created,
                } => out!(
                    "{name} is partitioned: its rows stay in {history} (everything \
                     before {history_until}), dropped by retention once that is past the \
                     window; {created} partitions created after it"
                ),
                _ => out!("{name} is partitioned already"),
            }
            Ok(())
        }
    }
}

fn list(layout: &PartitionLayout) {
    let when = |t: Option<chrono::DateTime<chrono::Utc>>, open: &str| {
        t.map_or_else(
            || open.to_owned(),
            |t| t.format("%Y-%m-%d %H:%M").to_string(),
        )
    };
    let rows: Vec<Vec<String>> = layout
        .partitions
        .iter()
        .map(|p| {
            vec![
                p.name.clone(),
                when(p.from, "(everything before)"),
                when(p.to, "(no end)"),
                p.estimated_rows
                    .map_or_else(|| "-".to_owned(), |r| r.to_string()),
                format!("{:.1} MB", p.bytes as f64 / 1e6),
                if p.detach_pending {
                    "detach pending".to_owned()
                } else {
                    String::new()
                },
            ]
        })
        .collect();
    ui::table(
        &["PARTITION", "FROM", "TO (UTC)", "ROWS (EST.)", "SIZE", ""],
        &[false, false, false, true, true, false],
        &rows,
    );
    out!(
        "{}: {} partitions, {} wide, kept {} ahead",
        layout.table.table_name(),
        layout.partitions.len(),
        parse::human(layout.width),
        parse::human(layout.ahead)
    );
}
