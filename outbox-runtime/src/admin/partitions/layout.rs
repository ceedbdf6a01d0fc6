//! A partitioned table's layout: its partitions as the catalog lists them, and its settings
//! (width, how far ahead), which [`set_partitioning`] changes.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use super::ahead::create_partitions;
use crate::admin::CleanupTable;
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

/// `name` as a quoted identifier.
pub(crate) fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
