//! The migrations runner: idempotent, safe from several processes at once, detects edits, and
//! creates the schema the rules require.

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_runtime::admin::CleanupTable;
use outbox_runtime::migrate::MIGRATIONS;
use outbox_runtime::Error;
use outbox_tests::{count, TestDb};
use sqlx::PgPool;

async fn ledger(pool: &PgPool) -> Vec<i64> {
    sqlx::query_scalar("SELECT version FROM outbox_schema_migrations ORDER BY version")
        .fetch_all(pool)
        .await
        .unwrap()
}

fn embedded_versions() -> Vec<i64> {
    MIGRATIONS.iter().map(|m| m.version).collect()
}

#[tokio::test]
async fn migrate_twice_is_a_no_op_the_second_time() {
    let db = TestDb::empty().await;
    outbox_runtime::migrate(&db.pool).await.unwrap();
    let first: Vec<(i64, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as("SELECT version, applied_at FROM outbox_schema_migrations ORDER BY version")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    outbox_runtime::migrate(&db.pool).await.unwrap();
    let second: Vec<(i64, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as("SELECT version, applied_at FROM outbox_schema_migrations ORDER BY version")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(first, second, "nothing is applied again");
    assert_eq!(ledger(&db.pool).await, embedded_versions());
}

#[tokio::test]
async fn migrate_from_several_processes_at_once() {
    let db = TestDb::empty().await;
    let children: Vec<_> = (0..4)
        .map(|_| {
            tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-test-migrate"))
                .arg(&db.url)
                .output()
        })
        .collect();
    for child in children {
        let out = child.await.expect("start migrate process");
        assert!(
            out.status.success(),
            "migrate process failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(ledger(&db.pool).await, embedded_versions());
    let tables = count(
        &db.pool,
        "SELECT count(*) FROM information_schema.tables \
         WHERE table_name IN ('outbox_event', 'inbox_event', 'processed_event')",
    )
    .await;
    assert_eq!(tables, 3);
}

#[tokio::test]
async fn an_edited_migration_is_refused() {
    let db = TestDb::new().await;
    sqlx::query("UPDATE outbox_schema_migrations SET checksum = checksum + 1 WHERE version = $1")
        .bind(MIGRATIONS[0].version)
        .execute(&db.pool)
        .await
        .unwrap();
    let err = outbox_runtime::migrate(&db.pool).await.unwrap_err();
    assert!(
        matches!(err, Error::MigrationChanged { version, .. } if version == MIGRATIONS[0].version)
    );
    assert!(
        err.to_string()
            .contains("applied migrations must never be edited"),
        "{err}"
    );
}

#[tokio::test]
async fn a_failing_migration_applies_nothing() {
    let db = TestDb::empty().await;
    // A conflicting table makes the first migration fail.
    sqlx::query("CREATE TABLE outbox_event (id int)")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = outbox_runtime::migrate(&db.pool).await.unwrap_err();
    assert!(
        outbox_runtime::error_chain(&err)
            .to_string()
            .starts_with(&format!(
                "migration {} (outbox_event) failed:",
                MIGRATIONS[0].version
            )),
        "{err}"
    );
    let ledger_exists: bool =
        sqlx::query_scalar("SELECT to_regclass('outbox_schema_migrations') IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(!ledger_exists, "the whole run rolled back");
    let inbox_exists: bool = sqlx::query_scalar("SELECT to_regclass('inbox_event') IS NOT NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(!inbox_exists);
}

#[test]
fn every_sql_file_is_embedded_in_order() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../outbox-runtime/migrations");
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(".sql"))
        .collect();
    files.sort();
    let embedded: Vec<String> = MIGRATIONS
        .iter()
        .map(|m| format!("{}_{}.sql", m.version, m.description))
        .collect();
    assert_eq!(files, embedded);
}

#[tokio::test]
async fn outbox_schema_is_the_reference_schema() {
    let db = TestDb::new().await;
    let columns: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT column_name::text, data_type::text, is_nullable::text \
         FROM information_schema.columns WHERE table_name = 'outbox_event' \
         ORDER BY ordinal_position",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let expected = [
        ("id", "bigint", "NO"),
        ("event_id", "uuid", "NO"),
        ("aggregate_type", "text", "NO"),
        ("aggregate_id", "text", "NO"),
        ("event_type", "text", "NO"),
        ("payload", "jsonb", "NO"),
        ("topic", "text", "NO"),
        ("partition_key", "text", "NO"),
        ("created_at", "timestamp with time zone", "NO"),
        ("published_at", "timestamp with time zone", "YES"),
    ];
    let reference: Vec<(String, String, String)> = expected
        .iter()
        .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
        .collect();
    assert_eq!(&columns[..reference.len()], &reference[..]);

    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexdef FROM pg_indexes WHERE indexname IN \
         ('ix_outbox_event_unpublished', 'ix_inbox_event_unprocessed') ORDER BY indexname",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        indexes,
        [
            "CREATE INDEX ix_inbox_event_unprocessed ON ONLY public.inbox_event USING btree (received_at) WHERE (NOT processed)",
            "CREATE INDEX ix_outbox_event_unpublished ON ONLY public.outbox_event USING btree (id) WHERE (published_at IS NULL)",
        ]
    );

    // A new installation's tables are partitioned by time; a partitioned table's keys hold
    // the partition key (uniqueness per event, and per event and handler, is the inserts').
    let layout = |pool: PgPool| async move {
        sqlx::query_as::<_, (String, String, Option<String>, Vec<String>)>(
            "SELECT c.relname::text, c.relkind::text, \
                    CASE WHEN c.relkind = 'p' THEN pg_get_partkeydef(c.oid) END, \
                    array_agg(pg_get_constraintdef(k.oid) ORDER BY k.conname) \
             FROM pg_class c JOIN pg_constraint k ON k.conrelid = c.oid AND k.contype IN ('p', 'u') \
             WHERE c.oid IN ('outbox_event'::regclass, 'inbox_event'::regclass, \
                             'processed_event'::regclass) \
             GROUP BY c.oid, c.relname, c.relkind ORDER BY c.relname",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let strings = |rows: &[(&str, &str, Option<&str>, &[&str])]| {
        rows.iter()
            .map(|(name, kind, key, constraints)| {
                (
                    name.to_string(),
                    kind.to_string(),
                    key.map(str::to_owned),
                    constraints
                        .iter()
                        .map(|c| c.to_string())
                        .collect::<Vec<_>>(),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        layout(db.pool.clone()).await,
        strings(&[
            (
                "inbox_event",
                "p",
                Some("RANGE (received_at)"),
                &["PRIMARY KEY (event_id, received_at)"]
            ),
            (
                "outbox_event",
                "p",
                Some("RANGE (created_at)"),
                &[
                    "UNIQUE (event_id, created_at)",
                    "PRIMARY KEY (id, created_at)"
                ]
            ),
            (
                "processed_event",
                "p",
                Some("RANGE (processed_at)"),
                &["PRIMARY KEY (event_id, handler, processed_at)"]
            ),
        ])
    );

    // An installation from before keeps its tables, and keys, as they were.
    let before = TestDb::before_partitions().await;
    assert_eq!(
        layout(before.pool.clone()).await,
        strings(&[
            ("inbox_event", "r", None, &["PRIMARY KEY (event_id)"]),
            (
                "outbox_event",
                "r",
                None,
                &["UNIQUE (event_id)", "PRIMARY KEY (id)"]
            ),
            (
                "processed_event",
                "r",
                None,
                &["PRIMARY KEY (event_id, handler)"]
            ),
        ])
    );
}

/// The kinds (`r` plain, `p` partitioned) of the outbox's and the inbox's tables.
async fn kinds(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT relkind::text FROM pg_class \
         WHERE oid IN ('outbox_event'::regclass, 'inbox_event'::regclass) ORDER BY relname",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// An installation of the version before, upgraded: partitioned only when it is new (nothing
/// ever written, no relay running); one whose outbox was used, though it is empty now, and one
/// with a relay holding its locks keep their plain tables.
#[tokio::test]
async fn only_a_new_installation_gets_partitioned_tables_on_upgrade() {
    const NEXT: &str = "partitioned_by_default";
    let fresh = TestDb::migrated_until(NEXT).await;
    assert_eq!(kinds(&fresh.pool).await, ["r", "r"]);
    outbox_runtime::migrate(&fresh.pool).await.unwrap();
    assert_eq!(kinds(&fresh.pool).await, ["p", "p"]);

    // Emptied: an emit that rolled back (its id drawn), as retention leaves an idle service.
    let emptied = TestDb::migrated_until(NEXT).await;
    let mut tx = emptied.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, \
             payload, topic, partition_key) \
         VALUES (gen_random_uuid(), 'A', 'a', 'E', '{}', 't.events', 'k')",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    outbox_runtime::migrate(&emptied.pool).await.unwrap();
    assert_eq!(kinds(&emptied.pool).await, ["r", "r"]);

    // A relay of the version before runs (its member lock, keyed by the outbox's oid).
    let running = TestDb::migrated_until(NEXT).await;
    let mut relay = running.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock('outbox_event'::regclass::oid::int4, 1291845632)")
        .execute(&mut *relay)
        .await
        .unwrap();
    outbox_runtime::migrate(&running.pool).await.unwrap();
    assert_eq!(kinds(&running.pool).await, ["r", "r"]);
    drop(relay);
}

/// What a table is made of, in words that do not depend on how it was made: its columns
/// (type, nullability, default, identity), constraints and indexes, partition key, and those
/// of a partition it would get now (reloptions, indexes).
async fn shape(pool: &PgPool, table: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT format('column %s %s %s default %s identity %s', column_name, data_type, \
                       is_nullable, column_default, is_identity) \
         FROM information_schema.columns WHERE table_name = $1 AND table_schema = 'public' \
         UNION ALL \
         SELECT format('constraint %s %s', conname, pg_get_constraintdef(oid)) \
         FROM pg_constraint WHERE conrelid = $1::regclass \
         UNION ALL \
         SELECT format('index %s', indexdef) FROM pg_indexes \
         WHERE tablename = $1 AND schemaname = 'public' \
         UNION ALL \
         SELECT format('partitioned %s', pg_get_partkeydef($1::regclass)) \
         UNION ALL \
         SELECT format('identity from %s', \
                       nextval(pg_get_serial_sequence($1, 'id')) - \
                       (SELECT max(id) FROM outbox_event)) \
         WHERE $1 = 'outbox_event' \
         UNION ALL \
         SELECT format('partition options %s indexes %s', c.reloptions, \
                       (SELECT array_agg(d ORDER BY d) \
                        FROM (SELECT regexp_replace(indexdef, 'INDEX \\S+ ON \\S+', '') AS d \
                              FROM pg_indexes WHERE tablename = c.relname) i)) \
         FROM pg_class c WHERE c.oid = (SELECT partition FROM outbox_partitions($1::regclass) \
                                        ORDER BY upper_bound DESC NULLS LAST LIMIT 1) \
         ORDER BY 1",
    )
    .bind(table)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A new installation's partitioned tables are those an installation from before gets from
/// `convert_to_partitions`: the migration that makes them and the conversion cannot drift.
#[tokio::test]
async fn a_new_installation_is_partitioned_as_a_converted_one() {
    let new = TestDb::new().await;
    let before = TestDb::before_partitions().await;
    for db in [&new, &before] {
        // One event each, so that the identity's next value can be compared.
        sqlx::query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, \
                 payload, topic, partition_key) \
             VALUES (gen_random_uuid(), 'A', 'a', 'E', '{}', 't.events', 'k')",
        )
        .execute(&db.pool)
        .await
        .unwrap();
    }
    for table in [
        CleanupTable::Outbox,
        CleanupTable::Inbox,
        CleanupTable::ProcessedEvent,
    ] {
        let converted = outbox_runtime::admin::convert_to_partitions(&before.pool, table)
            .await
            .unwrap();
        assert!(
            matches!(
                converted,
                outbox_runtime::admin::Conversion::Converted { .. }
            ),
            "{converted:?}"
        );
        let name = table.table_name();
        let made = shape(&new.pool, name).await;
        assert_eq!(made, shape(&before.pool, name).await, "{name}");
        assert!(
            made.iter().any(|l| l.starts_with("partitioned RANGE")),
            "{made:#?}"
        );
    }
}

#[tokio::test]
async fn a_new_installation_has_dedup_partitions_from_now_to_three_days_ahead() {
    let db = TestDb::new().await;
    let layout = outbox_runtime::admin::partitions(&db.pool, CleanupTable::ProcessedEvent)
        .await
        .unwrap()
        .expect("processed_event is partitioned");
    assert_eq!(layout.width, Duration::from_secs(86_400));
    assert_eq!(layout.ahead, Duration::from_secs(3 * 86_400));
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let first = &layout.partitions[0];
    assert_eq!(first.name, "processed_event_history");
    assert_eq!(first.from, None);
    // Daily partitions, back to back, from the start of today (UTC) past three days ahead.
    let today = now.date_naive().and_hms_opt(0, 0, 0).unwrap().and_utc();
    assert_eq!(first.to, Some(today));
    for pair in layout.partitions.windows(2) {
        assert_eq!(pair[0].to, pair[1].from, "{layout:#?}");
    }
    for p in &layout.partitions[1..] {
        let from = p.from.unwrap();
        assert_eq!(p.to, Some(from + chrono::Duration::days(1)));
        assert_eq!(
            p.name,
            format!("processed_event_{}", from.format("%Y%m%d_%H%M"))
        );
    }
    let last = layout.partitions.last().unwrap().to.unwrap();
    assert!(last >= now + chrono::Duration::days(3), "{last} {now}");
    assert!(last < now + chrono::Duration::days(4), "{last} {now}");
    // Created once: a second call finds nothing to do.
    assert_eq!(
        outbox_runtime::admin::create_partitions(&db.pool, CleanupTable::ProcessedEvent)
            .await
            .unwrap(),
        0
    );
}

#[tokio::test]
async fn the_churning_tables_get_autovacuum_settings_that_suit_a_queue() {
    let db = TestDb::new().await;
    // A new installation's outbox and inbox are partitioned: each partition has them (a
    // partitioned table has no storage options of its own).
    let options: Vec<(String, Vec<String>)> = sqlx::query_as(
        "SELECT p.partition::text, c.reloptions::text[] \
         FROM unnest(ARRAY['outbox_event', 'inbox_event']) AS t(name) \
         CROSS JOIN LATERAL outbox_partitions(t.name::regclass) p \
         JOIN pg_class c ON c.oid = p.partition ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let queue = [
        "autovacuum_vacuum_scale_factor=0",
        "autovacuum_vacuum_threshold=5000",
        "autovacuum_vacuum_cost_limit=2000",
        "autovacuum_analyze_scale_factor=0",
        "autovacuum_analyze_threshold=50000",
    ];
    for (table, reloptions) in &options {
        assert_eq!(reloptions, &queue, "{table}");
    }
    // The first partition and today's to three days ahead, of each.
    assert!(options.len() >= 2 * 5, "{options:?}");
    // The unpartitioned tables of an installation from before partitions have them too; a
    // partitioned processed_event's partitions have none: they are only inserted into, and
    // dropped whole.
    let before = TestDb::before_partitions().await;
    let plain: Vec<(String, Vec<String>)> = sqlx::query_as(
        "SELECT relname::text, reloptions::text[] FROM pg_class \
         WHERE oid IN ('outbox_event'::regclass, 'inbox_event'::regclass, \
                       'processed_event'::regclass) ORDER BY relname",
    )
    .fetch_all(&before.pool)
    .await
    .unwrap();
    assert_eq!(plain.len(), 3);
    for (table, reloptions) in &plain {
        assert_eq!(reloptions, &queue, "{table}");
    }
    let partitions_with_options = count(
        &db.pool,
        "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'processed_event'::regclass AND c.reloptions IS NOT NULL",
    )
    .await;
    assert_eq!(partitions_with_options, 0);
    // Autovacuum stays on for each of them: the health check sees no table of its own off.
    let report = outbox_runtime::admin::health(
        &db.pool,
        &outbox_runtime::admin::HealthThresholds::default(),
    )
    .await
    .unwrap();
    assert!(
        report.tables.iter().all(|t| t.autovacuum_enabled),
        "{report:#?}"
    );
}
