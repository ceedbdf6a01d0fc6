//! Converting a plain table to the partitioned layout in place: [`convert_to_partitions`].

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::admin::CleanupTable;
use crate::error::{Error, Result};
use crate::sqlstate::DbError;

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
                    (
                        "ix_inbox_event_pending",
                        "(seq) WHERE NOT processed AND dead_at IS NULL",
                    ),
                    (
                        "ix_inbox_event_shard_pending",
                        "((coalesce(hashtext(topic || E'\\x1f' || partition_key) & 63, 64)), seq) \
                         WHERE processed IS NOT TRUE AND dead_at IS NULL",
                    ),
                    (
                        "ix_inbox_event_key_retrying",
                        "(topic, partition_key, seq) \
                         WHERE next_attempt_at IS NOT NULL AND NOT processed AND dead_at IS NULL",
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
        let relays = crate::store::relay::members(&mut conn).await?;
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
