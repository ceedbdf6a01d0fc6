//! The health check's probes: what it reads from PostgreSQL's settings, statistics views and
//! catalogs, and from the framework's own tables, as plain figures. What they mean is decided
//! in `assess.rs`.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Row};

use super::report::TableHealth;
use crate::admin::partitions::{partitions, PartitionLayout};
use crate::admin::CleanupTable;
use crate::error::Result;
use crate::sqlstate::DbError;

/// The framework's tables; a partitioned one as the sum of its partitions: their rows, and the
/// vacuum of the one that needs it most (the oldest vacuum among those with dead rows, `NULL` if
/// one of them never had one; the latest when none has dead rows).
const TABLES_SQL: &str = "\
WITH t AS ( \
    SELECT coalesce(i.inhparent, c.oid) AS parent, c.relname::text AS rel, \
           s.n_live_tup, s.n_dead_tup, \
           coalesce((SELECT option_value FROM pg_options_to_table(c.reloptions) \
                     WHERE option_name = 'autovacuum_enabled'), 'on')::bool AS autovacuum, \
           extract(epoch FROM now() - greatest(s.last_vacuum, s.last_autovacuum))::float8 \
               AS vacuum_age, \
           extract(epoch FROM now() - greatest(s.last_analyze, s.last_autoanalyze))::float8 \
               AS analyze_age \
    FROM pg_class c JOIN pg_stat_all_tables s ON s.relid = c.oid \
    LEFT JOIN pg_inherits i ON i.inhrelid = c.oid \
    WHERE c.relkind = 'r' \
      AND coalesce(i.inhparent, c.oid) IN (to_regclass('outbox_event'), \
          to_regclass('inbox_event'), to_regclass('processed_event'), \
          to_regclass('outbox_relay_waiting')) \
) \
SELECT p.relname::text AS name, sum(n_live_tup)::int8 AS live, sum(n_dead_tup)::int8 AS dead, \
       bool_and(autovacuum) AS autovacuum, \
       coalesce(array_agg(rel ORDER BY rel) FILTER (WHERE NOT autovacuum), '{}') \
           AS autovacuum_off_in, \
       CASE WHEN bool_or(n_dead_tup > 0 AND vacuum_age IS NULL) THEN NULL \
            WHEN bool_or(n_dead_tup > 0) THEN max(vacuum_age) FILTER (WHERE n_dead_tup > 0) \
            ELSE min(vacuum_age) END AS vacuum_age, \
       min(analyze_age) AS analyze_age \
FROM t JOIN pg_class p ON p.oid = t.parent \
GROUP BY p.relname ORDER BY p.relname";

/// Each table of the framework, or partition of one, with at least `$1` dead rows: what
/// autovacuum decides by (its settings for it, or the server's; its rows as last counted), its
/// last vacuum, its lower bound (a partition), and whether a vacuum runs on it now.
const RELATIONS_SQL: &str = "\
SELECT p.relname::text AS table_name, \
       CASE WHEN i.inhparent IS NOT NULL THEN c.relname::text END AS partition, \
       s.n_dead_tup AS dead, greatest(c.reltuples, 0)::float8 AS reltuples, \
       coalesce((SELECT option_value FROM pg_options_to_table(c.reloptions) \
                 WHERE option_name = 'autovacuum_enabled'), 'on')::bool AS autovacuum, \
       coalesce((SELECT option_value FROM pg_options_to_table(c.reloptions) \
                 WHERE option_name = 'autovacuum_vacuum_threshold'), \
                current_setting('autovacuum_vacuum_threshold'))::float8 AS threshold, \
       coalesce((SELECT option_value FROM pg_options_to_table(c.reloptions) \
                 WHERE option_name = 'autovacuum_vacuum_scale_factor'), \
                current_setting('autovacuum_vacuum_scale_factor'))::float8 AS scale_factor, \
       greatest(s.last_vacuum, s.last_autovacuum) AS last_vacuum, \
       CASE WHEN i.inhparent IS NOT NULL THEN substring( \
           pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \\(''([^'']*)''\\)')::timestamptz \
       END AS lower_bound, \
       EXISTS (SELECT 1 FROM pg_stat_progress_vacuum v WHERE v.relid = c.oid) AS vacuuming \
FROM pg_class c JOIN pg_stat_all_tables s ON s.relid = c.oid \
LEFT JOIN pg_inherits i ON i.inhrelid = c.oid \
JOIN pg_class p ON p.oid = coalesce(i.inhparent, c.oid) \
WHERE c.relkind = 'r' AND s.n_dead_tup >= $1 \
  AND coalesce(i.inhparent, c.oid) IN (to_regclass('outbox_event'), \
      to_regclass('inbox_event'), to_regclass('processed_event'), \
      to_regclass('outbox_relay_waiting')) \
ORDER BY 1, 2";

/// Sessions of this database that hold the horizon of its tables: those with a transaction id
/// or a snapshot, but neither autovacuum's workers nor a plain `VACUUM` (PostgreSQL leaves
/// them out of the horizon), nor replication's senders (a standby's feedback is judged by its
/// age in transactions, [`STANDBYS_SQL`]).
const SESSIONS_SQL: &str = "\
SELECT pid, coalesce(application_name, '') AS application_name, \
       coalesce(usename::text, '') AS usename, coalesce(state, backend_type) AS state, \
       extract(epoch FROM now() - coalesce(xact_start, backend_start))::float8 AS age, \
       extract(epoch FROM now() - state_change)::float8 AS idle \
FROM pg_stat_activity \
WHERE pid <> pg_backend_pid() \
  AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) \
  AND backend_type NOT IN ('autovacuum worker', 'walsender') \
  AND datname = current_database() \
  AND NOT (state = 'active' AND query ~* '^\\s*vacuum\\y' AND query !~* '\\yfull\\y') \
ORDER BY coalesce(xact_start, backend_start)";

/// Standbys whose feedback (`hot_standby_feedback` without a slot) holds the horizon of every
/// database of the server.
const STANDBYS_SQL: &str = "\
SELECT pid, coalesce(application_name, '') AS application_name, \
       age(backend_xmin)::int8 AS xmin_age \
FROM pg_stat_replication WHERE backend_xmin IS NOT NULL ORDER BY age(backend_xmin) DESC";

const SLOTS_SQL: &str = "\
SELECT slot_name::text AS name, active, age(xmin)::int8 AS xmin_age \
FROM pg_replication_slots WHERE xmin IS NOT NULL ORDER BY age(xmin) DESC";

const PREPARED_SQL: &str = "\
SELECT gid, owner::text AS owner, extract(epoch FROM now() - prepared)::float8 AS age \
FROM pg_prepared_xacts WHERE database = current_database() ORDER BY prepared";

const MISSING_TOPICS_SQL: &str = "\
SELECT group_id, topic, source_topic, role, \
       extract(epoch FROM now() - seen_at)::float8 AS age \
FROM outbox_consumer_missing_topic ORDER BY group_id, topic";

const HELD_SQL: &str = "\
SELECT topic, count(*) AS rows, count(DISTINCT partition_key) AS keys, \
       max(last_error) AS error \
FROM outbox_event \
WHERE published_at IS NULL AND parked_at IS NULL AND held_at IS NOT NULL \
GROUP BY topic ORDER BY topic";

/// Whether the server's `autovacuum` and `track_counts` are on.
pub(super) async fn autovacuum(conn: &mut PgConnection) -> Result<(bool, bool)> {
    let settings = sqlx::query_as(
        "SELECT current_setting('autovacuum')::bool, current_setting('track_counts')::bool",
    )
    .fetch_one(conn)
    .await?;
    Ok(settings)
}

/// The framework's tables' vacuum figures ([`TABLES_SQL`]).
pub(super) async fn tables(conn: &mut PgConnection) -> Result<Vec<TableHealth>> {
    sqlx::query(TABLES_SQL)
        .fetch_all(conn)
        .await?
        .into_iter()
        .map(|r| {
            Ok(TableHealth {
                table: r.try_get("name")?,
                live_rows: r.try_get("live")?,
                dead_rows: r.try_get("dead")?,
                autovacuum_enabled: r.try_get("autovacuum")?,
                autovacuum_off_in: r.try_get("autovacuum_off_in")?,
                last_vacuum_age_secs: r.try_get("vacuum_age")?,
                last_analyze_age_secs: r.try_get("analyze_age")?,
            })
        })
        .collect()
}

/// A table, or a partition, with dead rows ([`RELATIONS_SQL`]).
pub(super) struct Relation {
    pub(super) table: String,
    pub(super) partition: Option<String>,
    pub(super) dead: i64,
    /// Its rows as last counted (0 before its first vacuum or analyze, as autovacuum takes it).
    pub(super) reltuples: f64,
    /// Its own `autovacuum_enabled`.
    pub(super) autovacuum: bool,
    /// Its `autovacuum_vacuum_threshold` (or the server's).
    pub(super) threshold: f64,
    /// Its `autovacuum_vacuum_scale_factor` (or the server's).
    pub(super) scale_factor: f64,
    pub(super) last_vacuum: Option<DateTime<Utc>>,
    /// A partition's lower bound (`None`: a plain table, or the first partition).
    pub(super) lower_bound: Option<DateTime<Utc>>,
    /// Whether a vacuum runs on it now (seen only with `pg_read_all_stats`, or our own role's).
    pub(super) vacuuming: bool,
}

/// The tables and partitions with at least `min_dead` dead rows.
pub(super) async fn relations(conn: &mut PgConnection, min_dead: i64) -> Result<Vec<Relation>> {
    sqlx::query(RELATIONS_SQL)
        .bind(min_dead)
        .fetch_all(conn)
        .await?
        .into_iter()
        .map(|r| {
            Ok(Relation {
                table: r.try_get("table_name")?,
                partition: r.try_get("partition")?,
                dead: r.try_get("dead")?,
                reltuples: r.try_get("reltuples")?,
                autovacuum: r.try_get("autovacuum")?,
                threshold: r.try_get("threshold")?,
                scale_factor: r.try_get("scale_factor")?,
                last_vacuum: r.try_get("last_vacuum")?,
                lower_bound: r.try_get("lower_bound")?,
                vacuuming: r.try_get("vacuuming")?,
            })
        })
        .collect()
}

/// What bounds how long a table can have held rows: the server's time, the installation's
/// first migration (no table of the framework is older), the statistics' last reset (dead
/// rows and vacuums are counted from it).
pub(super) struct Since {
    pub(super) now: DateTime<Utc>,
    pub(super) installed: Option<DateTime<Utc>>,
    pub(super) stats_reset: Option<DateTime<Utc>>,
}

pub(super) async fn since(conn: &mut PgConnection) -> Result<Since> {
    let (now, stats_reset): (DateTime<Utc>, Option<DateTime<Utc>>) = sqlx::query_as(
        "SELECT now(), (SELECT stats_reset FROM pg_stat_database \
                        WHERE datname = current_database())",
    )
    .fetch_one(&mut *conn)
    .await?;
    // A database migrated by other means has no ledger.
    let installed: Option<DateTime<Utc>> =
        sqlx::query_scalar("SELECT min(applied_at) FROM outbox_schema_migrations")
            .fetch_one(&mut *conn)
            .await
            .or_else(|e| {
                if DbError::is_undefined_table(&e) {
                    Ok(None)
                } else {
                    Err(e)
                }
            })?;
    Ok(Since {
        now,
        installed,
        stats_reset,
    })
}

/// A session of this database holding the cleanup horizon ([`SESSIONS_SQL`]).
pub(super) struct Session {
    pub(super) pid: i32,
    pub(super) application_name: String,
    pub(super) user: String,
    pub(super) state: String,
    /// Seconds since its transaction (or, without one, the session) began.
    pub(super) age_secs: f64,
    /// Seconds since its state last changed.
    pub(super) idle_secs: Option<f64>,
}

/// The sessions holding the horizon, the oldest first.
pub(super) async fn sessions(conn: &mut PgConnection) -> Result<Vec<Session>> {
    sqlx::query(SESSIONS_SQL)
        .fetch_all(conn)
        .await?
        .into_iter()
        .map(|row| {
            Ok(Session {
                pid: row.try_get("pid")?,
                application_name: row.try_get("application_name")?,
                user: row.try_get("usename")?,
                state: row.try_get("state")?,
                age_secs: row.try_get("age")?,
                idle_secs: row.try_get("idle")?,
            })
        })
        .collect()
}

/// A replication slot with an `xmin`.
pub(super) struct Slot {
    pub(super) name: String,
    pub(super) active: bool,
    /// How many transactions old its `xmin` is.
    pub(super) xmin_age: i64,
}

/// The replication slots that hold a horizon, the oldest first.
pub(super) async fn slots(conn: &mut PgConnection) -> Result<Vec<Slot>> {
    sqlx::query(SLOTS_SQL)
        .fetch_all(conn)
        .await?
        .into_iter()
        .map(|row| {
            Ok(Slot {
                name: row.try_get("name")?,
                active: row.try_get("active")?,
                xmin_age: row.try_get("xmin_age")?,
            })
        })
        .collect()
}

/// A standby whose feedback holds a horizon ([`STANDBYS_SQL`]).
pub(super) struct Standby {
    /// The pid of the server's sender to it.
    pub(super) pid: i32,
    pub(super) application_name: String,
    /// How many transactions old the horizon it asks for is.
    pub(super) xmin_age: i64,
}

/// The standbys whose feedback holds a horizon, the oldest first.
pub(super) async fn standbys(conn: &mut PgConnection) -> Result<Vec<Standby>> {
    sqlx::query(STANDBYS_SQL)
        .fetch_all(conn)
        .await?
        .into_iter()
        .map(|row| {
            Ok(Standby {
                pid: row.try_get("pid")?,
                application_name: row.try_get("application_name")?,
                xmin_age: row.try_get("xmin_age")?,
            })
        })
        .collect()
}

/// A prepared transaction of this database.
pub(super) struct Prepared {
    pub(super) gid: String,
    pub(super) owner: String,
    /// Seconds since it was prepared.
    pub(super) age_secs: f64,
}

/// This database's prepared transactions, the oldest first.
pub(super) async fn prepared(conn: &mut PgConnection) -> Result<Vec<Prepared>> {
    sqlx::query(PREPARED_SQL)
        .fetch_all(conn)
        .await?
        .into_iter()
        .map(|row| {
            Ok(Prepared {
                gid: row.try_get("gid")?,
                owner: row.try_get("owner")?,
                age_secs: row.try_get("age")?,
            })
        })
        .collect()
}

/// A topic's keys held for an operator.
pub(super) struct Held {
    pub(super) topic: String,
    /// Rows waiting behind the hold.
    pub(super) rows: i64,
    pub(super) keys: i64,
    /// The broker's error for one of them.
    pub(super) error: Option<String>,
}

/// The held keys, by topic.
pub(super) async fn held_keys(conn: &mut PgConnection) -> Result<Vec<Held>> {
    sqlx::query(HELD_SQL)
        .fetch_all(conn)
        .await?
        .into_iter()
        .map(|row| {
            Ok(Held {
                topic: row.try_get("topic")?,
                rows: row.try_get("rows")?,
                keys: row.try_get("keys")?,
                error: row.try_get("error")?,
            })
        })
        .collect()
}

/// A retry or dead-letter topic a consumer group found missing.
pub(super) struct MissingTopic {
    pub(super) group: String,
    pub(super) topic: String,
    /// The topic whose messages would go there.
    pub(super) source: String,
    /// `retry` or `dead_letter`.
    pub(super) role: String,
    /// Seconds since the consumer found it missing.
    pub(super) age_secs: f64,
}

/// The missing topics consumers recorded, by group and topic.
pub(super) async fn missing_topics(conn: &mut PgConnection) -> Result<Vec<MissingTopic>> {
    sqlx::query(MISSING_TOPICS_SQL)
        .fetch_all(conn)
        .await?
        .into_iter()
        .map(|row| {
            Ok(MissingTopic {
                group: row.try_get("group_id")?,
                topic: row.try_get("topic")?,
                source: row.try_get("source_topic")?,
                role: row.try_get("role")?,
                age_secs: row.try_get("age")?,
            })
        })
        .collect()
}

/// The server's time.
pub(super) async fn now(pool: &PgPool) -> Result<DateTime<Utc>> {
    Ok(sqlx::query_scalar("SELECT now()").fetch_one(pool).await?)
}

/// One of the tables that can be partitioned, as the partition warnings see it.
pub(super) enum Layout {
    /// A plain table, with the bound a conversion stopped midway left behind on it, if one did:
    /// the constraint's name, and from when it refuses inserts.
    Plain {
        table: CleanupTable,
        bound: Option<(String, DateTime<Utc>)>,
    },
    /// A partitioned table, with those of its partitions whose concurrent detach was
    /// interrupted (pending, and no session runs it).
    Partitioned {
        layout: PartitionLayout,
        interrupted: Vec<String>,
    },
}

/// Every table that can be partitioned, in [`CleanupTable::ALL`]'s order.
pub(super) async fn layouts(pool: &PgPool) -> Result<Vec<Layout>> {
    let mut layouts = Vec::new();
    for table in CleanupTable::ALL {
        let Some(layout) = partitions(pool, table).await? else {
            // A plain table: a conversion stopped midway leaves its bound behind.
            let name = table.table_name();
            let bound: Option<(String, DateTime<Utc>)> = sqlx::query_as(
                r#"SELECT conname::text,
                          substring(pg_get_constraintdef(oid) FROM $$'([^']*)'$$)::timestamptz
                   FROM pg_constraint
                   WHERE conrelid = to_regclass($1) AND conname = $1 || '_before_partitions'"#,
            )
            .bind(name)
            .fetch_optional(pool)
            .await?;
            layouts.push(Layout::Plain { table, bound });
            continue;
        };
        let mut interrupted = Vec::new();
        for p in layout.partitions.iter().filter(|p| p.detach_pending) {
            // A detach still running shows as pending too (its first transaction committed
            // the mark): only one that no session runs is interrupted.
            let running: bool = sqlx::query_scalar(
                r#"SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE state = 'active'
                     AND pid <> pg_backend_pid() AND datname = current_database()
                     AND query ~* ('detach\s+partition\s+"?' || $1 || '"?(\s|$)'))"#,
            )
            .bind(regex_escape(&p.name))
            .fetch_one(pool)
            .await?;
            if running {
                continue;
            }
            interrupted.push(p.name.clone());
        }
        layouts.push(Layout::Partitioned {
            layout,
            interrupted,
        });
    }
    Ok(layouts)
}

/// The partitions retention kept past its window, as its last runs recorded them (and still
/// there): table, partition, reason.
pub(super) async fn kept_partitions(pool: &PgPool) -> Result<Vec<(String, String, String)>> {
    // Before the migration that adds it, there is none (and no partitioned inbox).
    let kept: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT parent, partition, reason FROM outbox_partition_kept k \
         WHERE to_regclass(quote_ident(k.partition)) IS NOT NULL ORDER BY since, partition",
    )
    .fetch_all(pool)
    .await
    .or_else(|e| {
        if DbError::is_undefined_table(&e) {
            Ok(Vec::new())
        } else {
            Err(e)
        }
    })?;
    Ok(kept)
}

/// `name` as a literal in a PostgreSQL regular expression.
fn regex_escape(name: &str) -> String {
    name.chars().fold(String::new(), |mut out, c| {
        if !c.is_ascii_alphanumeric() && c != '_' {
            out.push('\\');
        }
        out.push(c);
        out
    })
}
