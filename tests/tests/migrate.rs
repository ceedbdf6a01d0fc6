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
            "CREATE INDEX ix_inbox_event_unprocessed ON public.inbox_event USING btree (received_at) WHERE (NOT processed)",
            "CREATE INDEX ix_outbox_event_unpublished ON public.outbox_event USING btree (id) WHERE (published_at IS NULL)",
        ]
    );

    // A new installation's dedup records are partitioned by time; a partitioned table's key
    // holds the partition key (uniqueness per event and handler is the consumers' insert's).
    let dedup_key: String = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint \
         WHERE conrelid = 'processed_event'::regclass AND contype = 'p'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(dedup_key, "PRIMARY KEY (event_id, handler, processed_at)");
    let partitioning: String =
        sqlx::query_scalar("SELECT pg_get_partkeydef('processed_event'::regclass)")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(partitioning, "RANGE (processed_at)");

    // An installation from before keeps its table, and key, as they were.
    let before = TestDb::before_partitions().await;
    let (kind, dedup_key): (String, String) = sqlx::query_as(
        "SELECT c.relkind::text, pg_get_constraintdef(k.oid) \
         FROM pg_class c JOIN pg_constraint k ON k.conrelid = c.oid AND k.contype = 'p' \
         WHERE c.oid = 'processed_event'::regclass",
    )
    .fetch_one(&before.pool)
    .await
    .unwrap();
    assert_eq!(
        (kind.as_str(), dedup_key.as_str()),
        ("r", "PRIMARY KEY (event_id, handler)")
    );
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
    let options: Vec<(String, Vec<String>)> = sqlx::query_as(
        "SELECT relname::text, reloptions::text[] FROM pg_class \
         WHERE oid IN ('outbox_event'::regclass, 'inbox_event'::regclass) ORDER BY relname",
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
    assert_eq!(options.len(), 2);
    // An unpartitioned processed_event (an installation from before partitions) has them too;
    // a partitioned one's partitions have none: they are only inserted into, and dropped whole.
    let before = TestDb::before_partitions().await;
    let plain: Vec<String> = sqlx::query_scalar(
        "SELECT unnest(reloptions) FROM pg_class WHERE oid = 'processed_event'::regclass",
    )
    .fetch_all(&before.pool)
    .await
    .unwrap();
    assert_eq!(plain, queue);
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
