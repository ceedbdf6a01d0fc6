//! Time partitions: what a partitioned table holds, creating partitions ahead of time, dropping
//! those past their retention, and converting an unpartitioned table in place.
//!
//! `processed_event` (by `processed_at`), `inbox_event` (by `received_at`) and `outbox_event`
//! (by `created_at`) can be partitioned: a new installation gets a partitioned
//! `processed_event`, and an existing one keeps its plain table until
//! [`convert_to_partitions`]; `inbox_event` and `outbox_event` are partitioned only by
//! [`convert_to_partitions`] (opt-in in this version). A table's layout (partition width, how
//! far ahead partitions exist, the new partitions' storage options) is a row of
//! `outbox_partitioning`, which [`set_partitioning`] changes. The SQL functions
//! `outbox_partitions` (migration `..._013_processed_event_partitions`) and
//! `outbox_create_partitions` (`..._015_inbox_event_partitions`) do the work, so an operator
//! can call them from `psql` too.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use super::CleanupTable;
use crate::error::{Error, Result};
use crate::sqlstate::DbError;

/// One partition of a partitioned table.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Partition {
    /// Its table's name.
    pub name: String,
    /// Its lower bound (inclusive); `None` for the first partition, which takes everything
    /// before its upper bound.
    pub from: Option<DateTime<Utc>>,
    /// Its upper bound (exclusive).
    pub to: Option<DateTime<Utc>>,
    /// Its rows, as PostgreSQL's statistics estimate them (`None` before its first vacuum or
    /// analyze).
    pub estimated_rows: Option<i64>,
    /// Its size on disk, indexes included.
    pub bytes: i64,
    /// A `DETACH ... CONCURRENTLY` of it was interrupted: retention finishes it.
    pub detach_pending: bool,
}

/// How a table is partitioned, and its partitions in order.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct PartitionLayout {
    /// The table.
    pub table: CleanupTable,
    /// The width of the partitions created from now on.
    #[serde(with = "secs")]
    pub width: Duration,
    /// How far past now partitions are kept created.
    #[serde(with = "secs")]
    pub ahead: Duration,
    /// Its partitions, by bound.
    pub partitions: Vec<Partition>,
}

impl PartitionLayout {
    /// How far past `now` the partitions reach (zero when none covers `now`): how long inserts
    /// would go on if nothing created partitions any more.
    pub fn covered_past(&self, now: DateTime<Utc>) -> Duration {
        let mut reach = now;
        for p in &self.partitions {
            if p.from.is_none_or(|from| from <= reach) && p.to.is_none_or(|to| to > reach) {
                match p.to {
                    Some(to) => reach = to,
                    None => return Duration::MAX,
                }
            }
        }
        (reach - now).to_std().unwrap_or_default()
    }
}

mod secs {
    pub(super) fn serialize<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_secs())
    }
}

/// `table`'s layout, or `None` if it is not partitioned (an installation not converted yet,
/// or a table that is never partitioned).
pub async fn partitions(pool: &PgPool, table: CleanupTable) -> Result<Option<PartitionLayout>> {
    let name = table.table_name();
    let settings: Option<(f64, f64)> = sqlx::query_as::<_, (f64, f64)>(
        "SELECT extract(epoch FROM width)::float8, extract(epoch FROM ahead)::float8 \
         FROM outbox_partitioning \
         WHERE parent = $1 AND EXISTS (SELECT 1 FROM pg_partitioned_table \
                                       WHERE partrelid = to_regclass($1))",
    )
    .bind(name)
    .fetch_optional(pool)
    .await
    .map(Some)
    .or_else(absent_as_none)?
    .flatten();
    let Some((width, ahead)) = settings else {
        return Ok(None);
    };
    let rows: Vec<PartitionRow> = sqlx::query_as(
        "SELECT c.relname::text, p.lower_bound, p.upper_bound, p.detach_pending, \
                    c.reltuples, pg_total_relation_size(c.oid) \
             FROM outbox_partitions(to_regclass($1)) p \
             JOIN pg_class c ON c.oid = p.partition \
             ORDER BY p.upper_bound NULLS LAST, p.lower_bound NULLS FIRST",
    )
    .bind(name)
    .fetch_all(pool)
    .await?;
    Ok(Some(PartitionLayout {
        table,
        width: Duration::from_secs_f64(width),
        ahead: Duration::from_secs_f64(ahead),
        partitions: rows
            .into_iter()
            .map(
                |(name, from, to, detach_pending, reltuples, bytes)| Partition {
                    name,
                    from,
                    to,
                    estimated_rows: (reltuples >= 0.0).then_some(reltuples as i64),
                    bytes,
                    detach_pending,
                },
            )
            .collect(),
    }))
}

/// A partition as the catalog describes it: name, bounds, detach pending, estimated rows, bytes.
type PartitionRow = (
    String,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
    bool,
    f32,
    i64,
);

/// `outbox_partitioning` is missing before the migrations that add it: no partitions then.
fn absent_as_none<T>(e: sqlx::Error) -> Result<Option<T>> {
    if DbError::is_undefined_table(&e) {
        Ok(None)
    } else {
        Err(e.into())
    }
}

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

/// Changes how `table` is partitioned from its last partition on: each new partition `width`
/// wide (a whole number of minutes, at most 31 days), and partitions kept created `ahead`
/// of now (at least an hour; a day or more leaves time to notice when nothing creates them).
/// Then creates what is missing.
pub async fn set_partitioning(
    pool: &PgPool,
    table: CleanupTable,
    width: Duration,
    ahead: Duration,
) -> Result<u32> {
    if width < Duration::from_secs(60)
        || width > Duration::from_secs(31 * 86_400)
        || width.as_secs() % 60 != 0
        || width.subsec_nanos() != 0
    {
        return Err(Error::Config(format!(
            "a partition width must be a whole number of minutes between 1 minute and 31 days, \
             not {width:?}"
        )));
    }
    if ahead < Duration::from_secs(3600) {
        return Err(Error::Config(format!(
            "partitions must be created at least an hour ahead, not {ahead:?}"
        )));
    }
    let updated = sqlx::query(
        "UPDATE outbox_partitioning \
         SET width = make_interval(secs => $2), ahead = make_interval(secs => $3) \
         WHERE parent = $1",
    )
    .bind(table.table_name())
    .bind(width.as_secs() as f64)
    .bind(ahead.as_secs_f64())
    .execute(pool)
    .await?
    .rows_affected();
    if updated == 0 {
        return Err(Error::Config(format!(
            "{} is never partitioned",
            table.table_name()
        )));
    }
    create_partitions(pool, table).await
}

#[cfg(feature = "_broker")]
/// Whether `error` is an insert that found no partition for its row
/// ([`DbError::is_missing_partition`]): creating partitions is the cure.
pub(crate) fn is_missing_partition(error: &Error) -> bool {
    match error {
        Error::Database(e) => DbError::is_missing_partition(e),
        _ => false,
    }
}

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
    super::delete::delete_in_batches(
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

/// `name` as a quoted identifier.
pub(crate) fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// What [`convert_to_partitions`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub enum Conversion {
    /// The table was partitioned already: nothing done.
    AlreadyPartitioned,
    /// The table is partitioned now: its rows stay where they are, in its first partition
    /// (`<table>_history`, everything before `history_until`), which retention drops once that
    /// bound is past the window; new rows go to partitions from `history_until` on.
    Converted {
        /// The name the old table has now, as the first partition.
        history: String,
        /// The first partition's upper bound.
        history_until: DateTime<Utc>,
        /// The partitions created after it.
        created: u32,
    },
}

/// The steps' bounds on waiting for a lock.
const CONVERT_LOCK_TIMEOUT: &str = "5s";

/// How long a step's transaction may sit idle holding its locks (its client gone quiet)
/// before the server ends it.
const CONVERT_IDLE_TIMEOUT: &str = "10s";

/// What converting a table needs to know of it.
struct Shape {
    /// The table.
    name: &'static str,
    /// The partitioned key's columns (the partition column last).
    key: &'static str,
    /// The partition column.
    column: &'static str,
    /// The partitioned table's other unique constraints: name, and columns (the partition
    /// column last). The old table has one of each name on the columns without the partition
    /// column, which goes; a unique index on the new columns is built for its partition.
    uniques: &'static [(&'static str, &'static str)],
    /// The partitioned table's other indexes: name, and what follows `ON <table>`. The old
    /// table has the same ones (the migrations made them), which become its partition's.
    indexes: &'static [(&'static str, &'static str)],
    /// Whether `id` is an identity column: the partitioned table gets a sequence of its own,
    /// which goes on from the old one's last value.
    identity: bool,
    /// Whether relays lock their shards under the table's oid: it converts only while none
    /// runs.
    relays_lock_it: bool,
}

impl Shape {
    fn of(table: CleanupTable) -> Result<Shape> {
        match table {
            CleanupTable::ProcessedEvent => Ok(Shape {
                name: "processed_event",
                key: "event_id, handler, processed_at",
                column: "processed_at",
                uniques: &[],
                indexes: &[],
                identity: false,
                relays_lock_it: false,
            }),
            CleanupTable::Inbox => Ok(Shape {
                name: "inbox_event",
                key: "event_id, received_at",
                column: "received_at",
                uniques: &[],
                identity: false,
                relays_lock_it: false,
                indexes: &[
                    (
                        "ix_inbox_event_unprocessed",
                        "(received_at) WHERE NOT processed",
                    ),
                    (
                        "ix_inbox_event_dead",
                        "(received_at) WHERE dead_at IS NOT NULL",
                    ),
                ],
            }),
            CleanupTable::Outbox => Ok(Shape {
                name: "outbox_event",
                key: "id, created_at",
                column: "created_at",
                uniques: &[("outbox_event_event_id_key", "event_id, created_at")],
                identity: true,
                relays_lock_it: true,
                indexes: &[
                    (
                        "ix_outbox_event_unpublished",
                        "(id) WHERE published_at IS NULL",
                    ),
                    (
                        "ix_outbox_event_retrying",
                        "(partition_key) WHERE published_at IS NULL AND next_attempt_at IS NOT NULL",
                    ),
                    ("ix_outbox_event_parked", "(id) WHERE parked_at IS NOT NULL"),
                    (
                        "ix_outbox_event_published_at",
                        "(published_at) WHERE published_at IS NOT NULL",
                    ),
                ],
            }),
        }
    }
}

/// Converts `table` to the partitioned layout in place, while consumers and emitters keep
/// running (consumers of this version or later: older ones insert with `ON CONFLICT` on the
/// old key, which the partitioned key does not catch, or which the partitioned table refuses).
/// `outbox_event` only with every relay stopped (refused otherwise: a relay locks its shards
/// under the table's oid, which this changes); start them again after. Nothing is copied: the
/// old table becomes the first partition. The steps, none of which holds a lock that consumers
/// or emitters wait on for longer than a moment:
///
/// 1. unique indexes matching the partitioned keys, built concurrently;
/// 2. a constraint bounding the old rows below the end of the partition width a day from
///    now, added `NOT VALID` and validated by a scan that inserts do not
///    wait for (if a later step fails, it is dropped again);
/// 3. one short transaction (waiting at most 5 s for its lock, tried again up to 5 times):
///    rename the old table (and its indexes), make the new index its key (the partitioned
///    key; dropping the old key's index is quick), create the partitioned table and its
///    indexes (an outbox's identity sequence going on from the old one's last value), attach
///    the old one as its first partition (the validated constraint spares a scan, its indexes
///    a build), create the partitions after it.
///
/// Safe to run again after it failed at any step (each checks what is done).
pub async fn convert_to_partitions(pool: &PgPool, table: CleanupTable) -> Result<Conversion> {
    let shape = Shape::of(table)?;
    let parent = shape.name;
    let kind: Option<String> =
        sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
            .bind(parent)
            .fetch_one(pool)
            .await?;
    match kind.as_deref() {
        Some("p") => return Ok(Conversion::AlreadyPartitioned),
        Some("r") => {}
        _ => {
            return Err(Error::Config(format!(
                "no {parent} table on the search_path: run the migrations"
            )))
        }
    }
    if shape.relays_lock_it {
        let mut conn = pool.acquire().await?;
        let relays = crate::relay::store::members(&mut conn).await?;
        if relays > 0 {
            return Err(Error::Config(format!(
                "{relays} relay instance(s) run on this outbox: stop them before converting \
                 outbox_event, and start them again after (they lock their shards under the \
                 table's oid, which the conversion changes; emitters may go on)"
            )));
        }
    }
    let history = format!("{parent}_history");
    let bound = format!("{parent}_before_partitions");
    // 1. The partitioned keys' indexes, the longest step (no lock inserts wait for); an
    // invalid one (an interrupted build) is built again.
    let keys = std::iter::once((format!("{parent}_partition_key"), shape.key)).chain(
        shape
            .uniques
            .iter()
            .enumerate()
            .map(|(i, (_, columns))| (format!("{parent}_partition_unique_{i}"), *columns)),
    );
    for (index, columns) in keys {
        sqlx::raw_sql(&format!(
            "SET LOCAL lock_timeout = '5s'; \
             DO $$ BEGIN \
               IF EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = \
                          to_regclass('{index}') AND NOT indisvalid) THEN \
                 DROP INDEX {index}; \
               END IF; \
             END $$"
        ))
        .execute(pool)
        .await?;
        sqlx::raw_sql(&format!(
            "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {parent} ({columns})"
        ))
        .execute(pool)
        .await?;
    }
    // 2. The bound: the end of the width a day from now (the old table takes the rows until
    // then: a validation scan or a swap that waits never outruns it, and a run killed here
    // leaves a day to run it again). A bound left by an earlier attempt goes first: it may be
    // close or past, and then refuses inserts.
    let until: DateTime<Utc> = sqlx::query_scalar(
        "SELECT date_bin(width, now() + interval '1 day', \
                         timestamptz '2000-01-01 00:00:00+00') + width \
         FROM outbox_partitioning WHERE parent = $1",
    )
    .bind(parent)
    .fetch_one(pool)
    .await?;
    let mut conn = pool.acquire().await?;
    with_lock_timeout(
        &mut conn,
        &format!(
            "ALTER TABLE {parent} DROP CONSTRAINT IF EXISTS {bound}; \
             ALTER TABLE {parent} ADD CONSTRAINT {bound} CHECK ({} < '{}') NOT VALID",
            shape.column,
            until.to_rfc3339()
        ),
    )
    .await?;
    drop(conn);
    let swapped = async {
        sqlx::raw_sql(&format!("ALTER TABLE {parent} VALIDATE CONSTRAINT {bound}"))
            .execute(pool)
            .await?;
        swap(pool, &shape, &history, until).await
    }
    .await;
    if let Err(e) = swapped {
        // Not left behind to refuse inserts once its bound passes: dropped, or named.
        let drop = format!("ALTER TABLE IF EXISTS {parent} DROP CONSTRAINT IF EXISTS {bound}");
        let mut attempt = 0;
        let dropped = loop {
            attempt += 1;
            let mut conn = pool.acquire().await?;
            let dropped = with_lock_timeout(&mut conn, &drop).await;
            if dropped.is_ok() || attempt == 5 {
                break dropped;
            }
            tokio::time::sleep(Duration::from_secs(attempt)).await;
        };
        if let Err(left) = dropped {
            return Err(Error::Config(format!(
                "converting {parent} failed ({}), and its constraint {bound} could not be \
                 dropped ({}): inserts fail from {until} on unless the conversion is run again \
                 or `{drop}` runs before then",
                crate::error_chain(&e),
                crate::error_chain(&left)
            )));
        }
        return Err(e);
    }
    swapped
}

/// Step 3 of [`convert_to_partitions`]: the old table becomes the first partition of a new
/// partitioned one.
async fn swap(
    pool: &PgPool,
    shape: &Shape,
    history: &str,
    until: DateTime<Utc>,
) -> Result<Conversion> {
    let Shape {
        name: parent,
        key,
        column,
        uniques,
        indexes,
        identity,
        relays_lock_it,
    } = shape;
    // 3. The swap. The new table takes the old one's columns and defaults (one definition:
    // the migrations'); its indexes are made before the attach, which then takes the old
    // table's matching ones as their partitions. (An attach takes a partition's index for a
    // constraint's only if it backs a constraint too.)
    // A session that stalls (its client's network gone) must not keep the lock that every
    // insert waits for: the server ends it.
    let mut swap = format!(
        "SET LOCAL lock_timeout = '{CONVERT_LOCK_TIMEOUT}';
         SET LOCAL idle_in_transaction_session_timeout = '{CONVERT_IDLE_TIMEOUT}';
         SET LOCAL statement_timeout = '60s';
         LOCK TABLE {parent} IN ACCESS EXCLUSIVE MODE;"
    );
    if *relays_lock_it {
        // Checked again under the lock: a relay that started since the first check would
        // keep its shards under the old table's oid beside relays under the new one.
        swap.push_str(&format!(
            "DO $$ BEGIN
               IF EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted
                          AND classid = '{parent}'::regclass::oid AND objsubid = 2
                          AND pid <> pg_backend_pid()
                          AND database = (SELECT oid FROM pg_database
                                          WHERE datname = current_database())) THEN
                 RAISE EXCEPTION 'a relay (or a retention run) holds its locks on {parent}: \
stop every relay before converting it, and start them again after';
               END IF;
             END $$;"
        ));
    }
    swap.push_str(&format!(
        "ALTER TABLE {parent} RENAME TO {history};
         ALTER TABLE {history} DROP CONSTRAINT {parent}_pkey;
         ALTER TABLE {history} ADD CONSTRAINT {history}_pkey
             PRIMARY KEY USING INDEX {parent}_partition_key;"
    ));
    let mut constraints = String::new();
    for (i, (name, columns)) in uniques.iter().enumerate() {
        swap.push_str(&format!(
            "ALTER TABLE {history} DROP CONSTRAINT {name};
             ALTER TABLE {history} ADD CONSTRAINT {}
                 UNIQUE USING INDEX {parent}_partition_unique_{i};",
            name.replacen(parent, history, 1)
        ));
        constraints.push_str(&format!(", CONSTRAINT {name} UNIQUE ({columns})"));
    }
    let including = if *identity {
        "INCLUDING DEFAULTS INCLUDING IDENTITY"
    } else {
        "INCLUDING DEFAULTS"
    };
    swap.push_str(&format!(
        "CREATE TABLE {parent} (
             LIKE {history} {including},
             PRIMARY KEY ({key}){constraints}
         ) PARTITION BY RANGE ({column});"
    ));
    if *identity {
        // Ids go on from the old sequence's last (no insert into the old table can draw one
        // now: it is locked), so `id` order stays emission order.
        // The old table's identity goes (its sequence with it): a partition may not have one
        // of its own (PostgreSQL 17 refuses the attach), and one source of ids is the point.
        swap.push_str(&format!(
            "SELECT setval(pg_get_serial_sequence('{parent}', 'id'),
                 coalesce(pg_sequence_last_value(
                     pg_get_serial_sequence('{history}', 'id')::regclass), 0) + 1,
                 false);
             ALTER TABLE {history} ALTER COLUMN id DROP IDENTITY;"
        ));
    }
    for (i, (index, definition)) in indexes.iter().enumerate() {
        swap.push_str(&format!(
            "ALTER INDEX {index} RENAME TO {history}_{i};
             CREATE INDEX {index} ON {parent} {definition};"
        ));
    }
    swap.push_str(&format!(
        "ALTER TABLE {parent} ATTACH PARTITION {history}
             FOR VALUES FROM (MINVALUE) TO ('{}');",
        until.to_rfc3339()
    ));
    let mut attempt = 0;
    loop {
        attempt += 1;
        let mut tx = pool.begin().await?;
        let swapped = sqlx::raw_sql(&swap).execute(&mut *tx).await;
        match swapped {
            Ok(_) => {
                let created: i32 =
                    sqlx::query_scalar("SELECT outbox_create_partitions(to_regclass($1))")
                        .bind(*parent)
                        .fetch_one(&mut *tx)
                        .await?;
                tx.commit().await?;
                tracing::info!(table = parent, %history, %until, created, "the table is partitioned now");
                return Ok(Conversion::Converted {
                    history: history.to_owned(),
                    history_until: until,
                    created: created.max(0) as u32,
                });
            }
            Err(e) if attempt < 5 && DbError::is_lock_not_available(&e) => {
                drop(tx);
                tracing::info!(
                    table = parent,
                    attempt,
                    "converting to partitions: the table's lock is busy; trying again"
                );
                tokio::time::sleep(Duration::from_secs(attempt)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Runs one DDL statement waiting at most [`CONVERT_LOCK_TIMEOUT`] for its lock.
async fn with_lock_timeout(conn: &mut sqlx::PgConnection, statement: &str) -> Result<()> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    sqlx::raw_sql(&format!(
        "SET LOCAL lock_timeout = '{CONVERT_LOCK_TIMEOUT}'; \
         SET LOCAL idle_in_transaction_session_timeout = '{CONVERT_IDLE_TIMEOUT}'; {statement}"
    ))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
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
