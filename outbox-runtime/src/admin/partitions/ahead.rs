//! Keeping partitions ahead of time: creating them, by hand, on a schedule or when an insert
//! found none.

#[cfg(feature = "_broker")]
use std::time::Duration;

use sqlx::PgPool;

use crate::admin::CleanupTable;
use crate::error::Result;

/// Creates `table`'s partitions up to its `ahead` past now; returns how many it created (0 for
/// a table that is not partitioned). Attaching a partition takes no lock inserts wait for; it
/// waits up to 5 s for one a long transaction reading the table holds, and fails then (call it
/// again later). Relays with retention call it at every run, dedup consumers when they start,
/// every hour and whenever an insert finds no partition.
pub async fn create_partitions(pool: &PgPool, table: CleanupTable) -> Result<u32> {
    // Asked first: the function is resolved when a statement is parsed, so a statement that
    // names it fails on a database without it (migrations not applied yet) however it is
    // guarded.
    let partitioned: bool = sqlx::query_scalar(
        "SELECT to_regprocedure('outbox_create_partitions(regclass,timestamptz)') IS NOT NULL \
            AND EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass($1))",
    )
    .bind(table.table_name())
    .fetch_one(pool)
    .await?;
    if !partitioned {
        return Ok(0);
    }
    let created: i32 = sqlx::query_scalar("SELECT outbox_create_partitions(to_regclass($1))")
        .bind(table.table_name())
        .fetch_one(pool)
        .await?;
    Ok(created.max(0) as u32)
}

#[cfg(feature = "_broker")]
/// How often a dedup consumer makes sure `processed_event`'s partitions exist ahead.
const KEEP_AHEAD_EVERY: Duration = Duration::from_secs(3600);

/// Creates `table`'s partitions ahead now and every hour until `cancel` fires (what a dedup
/// consumer runs beside its loop, so that an application without a relay keeps its
/// partitions too). A failure is logged and tried again at the next turn.
#[cfg(feature = "_broker")]
pub(crate) async fn keep_ahead(
    pool: PgPool,
    table: CleanupTable,
    cancel: tokio_util::sync::CancellationToken,
) {
    loop {
        match create_partitions(&pool, table).await {
            Ok(0) => {}
            Ok(created) => {
                tracing::info!(
                    table = table.table_name(),
                    created,
                    "created partitions ahead"
                )
            }
            Err(e) => tracing::warn!(
                table = table.table_name(),
                error = %crate::error_chain(&e),
                "cannot create partitions ahead; trying again in an hour"
            ),
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(KEEP_AHEAD_EVERY) => {}
        }
    }
}
