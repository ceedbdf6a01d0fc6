//! `outbox cleanup`: retention, table by table, after a count and a confirmation.

use outbox_runtime::admin::{Cleanup, CleanupTable};

use super::{chain, connect_migrated, when, Result};
use crate::args::CleanupArgs;
use crate::ui::{self, Progress};

pub async fn run(args: CleanupArgs) -> Result {
    let CleanupArgs {
        db,
        older_than,
        dedup_older_than,
        batch,
        mut tables,
        dry_run,
        yes,
    } = args;
    if tables.is_empty() {
        tables = CleanupTable::ALL.to_vec();
    }
    let mut seen = Vec::new();
    tables.retain(|t| {
        let new = !seen.contains(t);
        seen.push(*t);
        new
    });
    let pool = connect_migrated(&db, 2).await?;
    let outbox = Cleanup::new(pool.clone(), older_than).batch_size(batch);
    let dedup = Cleanup::new(pool, dedup_older_than.unwrap_or(older_than)).batch_size(batch);
    let outbox_cut = outbox.cutoff().await.map_err(chain)?;
    let dedup_cut = dedup.cutoff().await.map_err(chain)?;
    let mut plan = Vec::new();
    for &table in &tables {
        let (cleanup, cutoff) = match table {
            CleanupTable::Outbox => (&outbox, outbox_cut),
            _ => (&dedup, dedup_cut),
        };
        let n = cleanup.count(table, cutoff).await.map_err(chain)?;
        plan.push((table, cleanup, cutoff, n));
    }
    let total: u64 = plan.iter().map(|p| p.3).sum();
    let summary = plan
        .iter()
        .map(|(t, _, cutoff, n)| format!("{n} from {} (before {})", t.table_name(), when(*cutoff)))
        .collect::<Vec<_>>()
        .join(", ");
    if dry_run {
        out!("dry run: would delete {total} rows: {summary}");
        return Ok(());
    }
    if total == 0 {
        out!("nothing past the retention; nothing deleted");
        return Ok(());
    }
    ui::confirm(&format!("delete {total} rows: {summary}"), yes)?;
    for (table, cleanup, cutoff, expected) in plan {
        if expected == 0 {
            out!("{}: nothing to delete", table.table_name());
            continue;
        }
        let mut progress =
            Progress::new(format!("cleaning {}", table.table_name()), Some(expected));
        let result = cleanup
            .run(table, cutoff, |done| progress.update(done))
            .await;
        progress.finish();
        let deleted = result.map_err(chain)?;
        out!(
            "{}: deleted {deleted} rows older than {} in {:.2} s",
            table.table_name(),
            when(cutoff),
            progress.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
