//! `outbox partitions`: processed_event's time partitions.

use outbox_runtime::admin::{self, CleanupTable, Conversion, PartitionLayout};

use super::{chain, connect_migrated, print_json, Result};
use crate::{parse, ui, PartitionsAction};

const TABLE: CleanupTable = CleanupTable::ProcessedEvent;

pub async fn run(action: PartitionsAction) -> Result {
    match action {
        PartitionsAction::List { db, json } => {
            let pool = connect_migrated(&db, 2).await?;
            let layout = admin::partitions(&pool, TABLE).await.map_err(chain)?;
            if json {
                return print_json(&layout);
            }
            match layout {
                Some(layout) => list(&layout),
                None => out!(
                    "processed_event is not partitioned (an installation from before \
                     partitions): `outbox partitions convert` converts it in place"
                ),
            }
            Ok(())
        }
        PartitionsAction::Create { db } => {
            let pool = connect_migrated(&db, 2).await?;
            let created = admin::create_partitions(&pool, TABLE)
                .await
                .map_err(chain)?;
            out!("created {created} partitions of processed_event");
            Ok(())
        }
        PartitionsAction::Set { db, width, ahead } => {
            let pool = connect_migrated(&db, 2).await?;
            let created = admin::set_partitioning(&pool, TABLE, width, ahead)
                .await
                .map_err(chain)?;
            out!(
                "processed_event: partitions {} wide from the last one on, kept {} ahead; \
                 created {created}",
                parse::human(width),
                parse::human(ahead)
            );
            Ok(())
        }
        PartitionsAction::Convert { db, yes } => {
            let pool = connect_migrated(&db, 4).await?;
            if admin::partitions(&pool, TABLE)
                .await
                .map_err(chain)?
                .is_some()
            {
                out!("processed_event is partitioned already");
                return Ok(());
            }
            ui::confirm(
                "convert processed_event to partitions in place (consumers of an older \
                 version must be stopped: they do not deduplicate against the partitioned \
                 table)",
                yes,
            )?;
            match admin::convert_to_partitions(&pool, TABLE)
                .await
                .map_err(chain)?
            {
                Conversion::Converted {
                    history,
                    history_until,
                    created,
                } => out!(
                    "processed_event is partitioned: its rows stay in {history} (everything \
                     before {history_until}), dropped by retention once that is past the \
                     window; {created} partitions created after it"
                ),
                _ => out!("processed_event is partitioned already"),
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
        "processed_event: {} partitions, {} wide, kept {} ahead",
        layout.partitions.len(),
        parse::human(layout.width),
        parse::human(layout.ahead)
    );
}
