//! `outbox cleanup`: retention, table by table, after a count and a confirmation.

use chrono::{DateTime, Utc};
use outbox_runtime::admin::{Cleanup, CleanupTable};

use super::{chain, connect_migrated, connect_mysql_migrated, is_mysql, when, Result};
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
    let mysql = is_mysql(&db.database_url);
    if tables.is_empty() {
        tables = CleanupTable::ALL.to_vec();
        if mysql {
            // No inbox table there (inbox mode is not built on MariaDB/MySQL yet).
            tables.retain(|t| *t != CleanupTable::Inbox);
        }
    }
    let mut seen = Vec::new();
    tables.retain(|t| {
        let new = !seen.contains(t);
        seen.push(*t);
        new
    });
    let windows = (older_than, dedup_older_than.unwrap_or(older_than));
    if mysql {
        let pool = connect_mysql_migrated(&db, 2).await?;
        let [outbox, dedup] = [windows.0, windows.1]
            .map(|w| outbox_runtime::mysql::Cleanup::new(pool.clone(), w).batch_size(batch));
        return clean(&tables, [outbox, dedup], dry_run, yes).await;
    }
    let pool = connect_migrated(&db, 2).await?;
    let [outbox, dedup] =
        [windows.0, windows.1].map(|w| Cleanup::new(pool.clone(), w).batch_size(batch));
    clean(&tables, [outbox, dedup], dry_run, yes).await
}

/// A database's retention, as `outbox cleanup` drives it.
trait Cut {
    async fn cutoff(&self) -> outbox_runtime::Result<DateTime<Utc>>;
    async fn count(
        &self,
        table: CleanupTable,
        cutoff: DateTime<Utc>,
    ) -> outbox_runtime::Result<u64>;
    async fn run(
        &self,
        table: CleanupTable,
        cutoff: DateTime<Utc>,
        progress: impl FnMut(u64),
    ) -> outbox_runtime::Result<u64>;
}

/// Implements [`Cut`] by the type's own methods of the same names.
macro_rules! cut {
    ($t:ty) => {
        impl Cut for $t {
            async fn cutoff(&self) -> outbox_runtime::Result<DateTime<Utc>> {
                <$t>::cutoff(self).await
            }
            async fn count(
                &self,
                table: CleanupTable,
                cutoff: DateTime<Utc>,
            ) -> outbox_runtime::Result<u64> {
                <$t>::count(self, table, cutoff).await
            }
            async fn run(
                &self,
                table: CleanupTable,
                cutoff: DateTime<Utc>,
                progress: impl FnMut(u64),
            ) -> outbox_runtime::Result<u64> {
                <$t>::run(self, table, cutoff, progress).await
            }
        }
    };
}
cut!(Cleanup);
cut!(outbox_runtime::mysql::Cleanup);

/// Counts what `tables` would lose (the outbox by `outbox`'s window, the others by `dedup`'s),
/// shows it, and once confirmed deletes it, table by table.
async fn clean<C: Cut>(
    tables: &[CleanupTable],
    [outbox, dedup]: [C; 2],
    dry_run: bool,
    yes: bool,
) -> Result {
    let outbox_cut = outbox.cutoff().await.map_err(chain)?;
    let dedup_cut = dedup.cutoff().await.map_err(chain)?;
    let mut plan = Vec::new();
    for &table in tables {
        let (cleanup, cutoff) = match table {
            CleanupTable::Outbox => (&outbox, outbox_cut),
            _ => (&dedup, dedup_cut),
        };
        let n = cleanup.count(table, cutoff).await.map_err(chain)?;
        plan.push((table, cleanup, cutoff, n));
    }
    let Some(plan) = confirmed(plan, dry_run, yes)? else {
        return Ok(());
    };
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
        report(table, cutoff, result.map_err(chain)?, &progress);
    }
    Ok(())
}

/// Per table: its cleanup (PostgreSQL's or MariaDB's), its cut-off, the rows past it.
type Plan<C> = Vec<(CleanupTable, C, DateTime<Utc>, u64)>;

/// The plan, once shown and confirmed; `None` after
/// a dry run or when nothing is past the retention.
fn confirmed<C>(plan: Plan<C>, dry_run: bool, yes: bool) -> Result<Option<Plan<C>>> {
    let total: u64 = plan.iter().map(|p| p.3).sum();
    let summary = plan
        .iter()
        .map(|(t, _, cutoff, n)| format!("{n} from {} (before {})", t.table_name(), when(*cutoff)))
        .collect::<Vec<_>>()
        .join(", ");
    if dry_run {
        out!("dry run: would delete {total} rows: {summary}");
        return Ok(None);
    }
    if total == 0 {
        out!("nothing past the retention; nothing deleted");
        return Ok(None);
    }
    ui::confirm(&format!("delete {total} rows: {summary}"), yes)?;
    Ok(Some(plan))
}

/// What a table's cleanup did.
fn report(table: CleanupTable, cutoff: DateTime<Utc>, deleted: u64, progress: &Progress) {
    out!(
        "{}: deleted {deleted} rows older than {} in {:.2} s",
        table.table_name(),
        when(cutoff),
        progress.elapsed().as_secs_f64()
    );
}
