//! Retention on a partitioned table: dropping the partitions past the window, or keeping
//! those that hold rows still to be dealt with, and saying why.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::layout::{quote, PartitionLayout};
use crate::admin::CleanupTable;
use crate::error::{Error, Result};

/// What one [`drop_partitions`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct DroppedPartitions {
    /// The partitions dropped, by name.
    pub(crate) dropped: Vec<String>,
    /// Their rows (counted before each was detached), and the rows deleted from partitions
    /// kept.
    pub(crate) rows: u64,
    /// The partitions past the cut-off kept for rows an operator must see to, and why.
    pub(crate) kept: Vec<(String, String)>,
}

/// Why a partition past the cut-off stays.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Kept {
    /// It holds a row still to be dealt with, reported: an outbox row not published yet (the
    /// relay has not come to it, it waits for a retry or its key is held) or parked (`outbox
    /// parked`); an inbox row not processed yet (its processors have not come to it, or it
    /// waits for a retry) or dead (an operator retries or discards it: `outbox inbox dead`).
    Unsettled(String),
    /// Some of its rows were settled within the window (long after they were written: a
    /// retry, a revived parked or dead row): they keep the window's promise.
    RecentlyProcessed,
}

/// The SQL that counts a partition's rows to deal with (the two kinds) and says whether one was
/// settled after `$1`, with the kinds' names; `None` for a table whose partitions go whatever
/// they hold.
fn unsettled_sql(table: CleanupTable) -> Option<(&'static str, [&'static str; 2])> {
    match table {
        CleanupTable::Inbox => Some((
            "SELECT count(*) FILTER (WHERE NOT processed AND dead_at IS NULL), \
                    count(*) FILTER (WHERE NOT processed AND dead_at IS NOT NULL), \
                    coalesce(bool_or(processed AND processed_at >= $1), false) \
             FROM {} WHERE NOT processed OR processed_at >= $1",
            ["unprocessed", "dead"],
        )),
        CleanupTable::Outbox => Some((
            "SELECT count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL), \
                    count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NOT NULL), \
                    coalesce(bool_or(published_at >= $1), false) \
             FROM {} WHERE published_at IS NULL OR published_at >= $1",
            ["unpublished", "parked"],
        )),
        CleanupTable::ProcessedEvent => None,
    }
}

/// Why a partition of `table` must stay although it ended before `cutoff`, if it must (see
/// [`Kept`]). A `processed_event` partition never must: it holds dedup records only, and its
/// partition column is when they were recorded.
pub(crate) async fn kept_because(
    pool: &PgPool,
    table: CleanupTable,
    partition: &str,
    cutoff: DateTime<Utc>,
) -> Result<Option<Kept>> {
    let Some((sql, [first, second])) = unsettled_sql(table) else {
        return Ok(None);
    };
    let (pending, stuck, recent): (i64, i64, bool) =
        sqlx::query_as(&sql.replace("{}", &quote(partition)))
            .bind(cutoff)
            .fetch_one(pool)
            .await?;
    let plural = |n: i64, what: &str| format!("{n} {what} row{}", if n == 1 { "" } else { "s" });
    Ok(match (pending, stuck) {
        (0, 0) if recent => Some(Kept::RecentlyProcessed),
        (0, 0) => None,
        (p, 0) => Some(Kept::Unsettled(format!("it holds {}", plural(p, first)))),
        (0, d) => Some(Kept::Unsettled(format!("it holds {}", plural(d, second)))),
        (p, d) => Some(Kept::Unsettled(format!(
            "it holds {} and {}",
            plural(p, first),
            plural(d, second)
        ))),
    })
}

/// Drops the partitions of `layout`'s table that end at or before `cutoff`: each is detached
/// concurrently (inserts and reads go on) and then dropped; an interrupted detach is finished
/// first. A `processed_event` partition holds dedup records only, so it goes once it is past
/// the window whatever it holds. The first partition (the one without a lower bound) loses its
/// rows past the window meanwhile, as a plain table does. An `inbox_event` partition goes only
/// once every row in it is processed, and none within the window; one kept for an unprocessed
/// or dead row is recorded with the reason in `outbox_partition_kept` for `outbox status`, and
/// its rows processed before the cut-off are deleted meanwhile (as from a plain table), so that
/// one dead row does not keep a day of records. A detached partition is checked again before it is dropped (a
/// receipt whose transaction began before the detach could still have written to it): with
/// such a row, it is attached back.
pub(crate) async fn drop_partitions(
    pool: &PgPool,
    layout: PartitionLayout,
    cutoff: DateTime<Utc>,
    batch_size: i64,
) -> Result<DroppedPartitions> {
    let mut report = DroppedPartitions::default();
    let table = layout.table;
    let parent = table.table_name();
    let result = async {
        for p in layout.partitions {
            if p.to.is_none_or(|to| to > cutoff) {
                // The first partition takes everything from before the partitions began (a
                // converted table's rows, or rows written with an earlier time): until it is
                // past the window as a whole, its rows past it go as from a plain table.
                if p.from.is_none() && !p.detach_pending {
                    report.rows += trim(pool, table, &p.name, cutoff, batch_size).await?;
                }
                continue;
            }
            // An interrupted detach is finished first, whatever the partition holds: until
            // then its rows are out of every reader's sight.
            if !p.detach_pending {
                if let Some(kept) = kept_because(pool, table, &p.name, cutoff).await? {
                    report.rows += trim(pool, table, &p.name, cutoff, batch_size).await?;
                    // A partition with late records goes at a later run, unreported.
                    if let Kept::Unsettled(reason) = kept {
                        report.kept.push((p.name, reason));
                    }
                    continue;
                }
            }
            let rows: i64 =
                sqlx::query_scalar(&format!("SELECT count(*) FROM {}", quote(&p.name)))
                    .fetch_one(pool)
                    .await?;
            // Not in a transaction (DETACH ... CONCURRENTLY refuses one). A detach waits for
            // the transactions that may see the partition; it is bounded so that a long one
            // only delays retention to its next run (the detach, pending then, is finished
            // then).
            let how = if p.detach_pending {
                "FINALIZE"
            } else {
                "CONCURRENTLY"
            };
            detach(
                pool.clone(),
                format!("ALTER TABLE {parent} DETACH PARTITION {} {how}", quote(&p.name)),
            )
            .await?;
            if let Some(kept) = kept_because(pool, table, &p.name, cutoff).await? {
                let reason = match kept {
                    Kept::Unsettled(reason) => reason,
                    Kept::RecentlyProcessed => "it holds rows settled within the window".into(),
                };
                // Recorded first: if the attach fails, `outbox status` names the table.
                record_one(
                    pool,
                    parent,
                    &p.name,
                    &format!("{reason}; it is detached, and was not attached back"),
                )
                .await?;
                let from = p.from.map_or_else(
                    || "MINVALUE".to_owned(),
                    |f| format!("'{}'", f.to_rfc3339()),
                );
                let to = p.to.map_or_else(String::new, |t| t.to_rfc3339());
                sqlx::raw_sql(&format!(
                    "ALTER TABLE {parent} ATTACH PARTITION {} FOR VALUES FROM ({from}) TO ('{to}')",
                    quote(&p.name)
                ))
                .execute(pool)
                .await?;
                if table == CleanupTable::Outbox {
                    // Its unpublished rows were out of the relays' sight while it was detached:
                    // a relay's cursor may have passed them. Due now, they take it back.
                    sqlx::raw_sql(&format!(
                        "UPDATE {} SET next_attempt_at = now() \
                         WHERE published_at IS NULL AND parked_at IS NULL \
                           AND next_attempt_at IS NULL",
                        quote(&p.name)
                    ))
                    .execute(pool)
                    .await?;
                }
                tracing::warn!(table = parent, partition = %p.name, %reason,
                    "a detached partition past retention holds rows to keep: attached back");
                report.kept.push((p.name, reason));
                continue;
            }
            sqlx::raw_sql(&format!("DROP TABLE {}", quote(&p.name)))
                .execute(pool)
                .await?;
            tracing::info!(table = parent, partition = %p.name, rows, "dropped a partition past retention");
            report.rows += rows.max(0) as u64;
            report.dropped.push(p.name);
        }
        Ok::<(), Error>(())
    }
    .await;
    for (partition, reason) in &report.kept {
        tracing::warn!(table = parent, %partition, %reason, "a partition past retention is kept");
    }
    // Only once every partition was seen: an early error leaves the last run's record.
    if result.is_ok() && unsettled_sql(table).is_some() {
        record_kept(pool, parent, &report.kept).await?;
    }
    result.map(|()| report)
}

/// Deletes a kept partition's rows settled (published, processed) before `cutoff`, in batches
/// (each its own short transaction, skipping rows another transaction holds), as retention
/// does on a plain table. Returns how many it deleted.
async fn trim(
    pool: &PgPool,
    table: CleanupTable,
    partition: &str,
    cutoff: DateTime<Utc>,
    batch_size: i64,
) -> Result<u64> {
    crate::admin::delete::delete_in_batches(
        pool,
        &quote(partition),
        table.condition(),
        table.age_column(),
        cutoff,
        batch_size,
        |_| {},
    )
    .await
}

/// Records one partition kept, with its reason.
async fn record_one(pool: &PgPool, parent: &str, partition: &str, reason: &str) -> Result<()> {
    let mut conn = pool.acquire().await?;
    upsert_kept(&mut conn, parent, &[partition], &[reason]).await
}

/// Replaces `parent`'s rows of `outbox_partition_kept` with `kept` (a partition kept since an
/// earlier run keeps its `since`).
async fn record_kept(pool: &PgPool, parent: &str, kept: &[(String, String)]) -> Result<()> {
    let (names, reasons): (Vec<&str>, Vec<&str>) =
        kept.iter().map(|(p, r)| (p.as_str(), r.as_str())).unzip();
    let mut tx = pool.begin().await?;
    sqlx::query("DELETE FROM outbox_partition_kept WHERE parent = $1 AND partition <> ALL($2)")
        .bind(parent)
        .bind(&names)
        .execute(&mut *tx)
        .await?;
    upsert_kept(&mut tx, parent, &names, &reasons).await?;
    tx.commit().await?;
    Ok(())
}

/// Records `parent`'s partitions kept with their reasons, a reason replacing an earlier one.
async fn upsert_kept(
    conn: &mut sqlx::PgConnection,
    parent: &str,
    names: &[&str],
    reasons: &[&str],
) -> Result<()> {
    sqlx::query(
        "INSERT INTO outbox_partition_kept (partition, parent, reason) \
         SELECT k.p, $1, k.r FROM unnest($2::text[], $3::text[]) AS k(p, r) \
         ON CONFLICT (partition) DO UPDATE SET reason = excluded.reason",
    )
    .bind(parent)
    .bind(names)
    .bind(reasons)
    .execute(conn)
    .await?;
    Ok(())
}

/// Runs a `DETACH PARTITION` on a connection of its own, outside a transaction, bounded to a
/// minute. Statements of the extended protocol (`sqlx::raw_sql` on a `&mut PgConnection` makes
/// a future that the relay's spawned retention task cannot prove `Send`).
async fn detach(pool: PgPool, sql: String) -> Result<()> {
    let mut conn = pool.acquire().await?;
    sqlx::query("SET statement_timeout = '60s'")
        .execute(&mut *conn)
        .await?;
    let detached = sqlx::query(&sql).execute(&mut *conn).await;
    let reset = sqlx::query("RESET statement_timeout")
        .execute(&mut *conn)
        .await;
    detached?;
    reset?;
    Ok(())
}
