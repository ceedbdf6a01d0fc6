//! `inbox_event` in time partitions (a new installation's; `convert_to_partitions` for one from before): an event is stored once
//! across a partition boundary (a redelivery after its first receipt's partition rolled over),
//! a consumer creates the partition it finds missing, retention drops a partition only once
//! every row in it is processed (one with an unprocessed or a dead row is kept and reported),
//! and an installation from before converts while a consumer runs, its processors sharing the
//! keys' shards with those started after.

use std::time::Duration;

use outbox_runtime::admin::{self, CleanupTable, Conversion, HealthThresholds, Retention};
use outbox_runtime::inbox::{Consumer, Mode};
use outbox_tests::fixtures::{self, PAYMENTS};
use outbox_tests::kafka::{committed_total, produce, Kafka};
use outbox_tests::payments::{
    builder, orders_with_payments, orders_with_special_payments, paid_counts, records, setup,
    wait_for, PARTITIONS,
};
use outbox_tests::{count, Running, TestDb};
use sqlx::PgPool;

fn inbox_consumer(db: &TestDb, kafka: &Kafka) -> Consumer {
    builder(db, kafka, "orders")
        .handler(fixtures::mark_order_paid)
        .mode(Mode::Inbox)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap()
}

/// Waits until `n` messages were consumed and committed, and the inbox holds `processed`
/// processed rows.
async fn settled(db: &TestDb, kafka: &Kafka, n: i64, processed: i64) {
    wait_for(
        "every message consumed and its row processed",
        Duration::from_secs(60),
        || async {
            committed_total(&kafka.bootstrap(), "orders", PAYMENTS, PARTITIONS) == n
                && count(&db.pool, "SELECT count(*) FROM inbox_event WHERE processed").await
                    == processed
        },
    )
    .await;
}

/// A new installation's inbox is partitioned already: converting it does nothing.
async fn partitioned(pool: &PgPool) {
    let conversion = admin::convert_to_partitions(pool, CleanupTable::Inbox)
        .await
        .unwrap();
    assert_eq!(conversion, Conversion::AlreadyPartitioned);
}

/// The partitions (their tables' names) that hold the inbox's rows.
async fn holding(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT DISTINCT tableoid::regclass::text FROM inbox_event ORDER BY 1")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_after_its_first_receipts_inbox_partition_rolled_over_is_stored_once() {
    let (db, kafka) = setup().await;
    partitioned(&db.pool).await;
    fixtures::partitions_since(&db.pool, "inbox_event", 3).await;
    let payments = orders_with_payments(&db.pool, 100).await;
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
    let running = Running::consumer(&inbox_consumer(&db, &kafka));
    settled(&db, &kafka, 100, 100).await;
    let today = holding(&db.pool).await;
    assert_eq!(today.len(), 1, "{today:?}");

    // The first receipts' partition rolls over: their rows are in yesterday's partition now,
    // and today's (where a redelivery's row goes) holds none of them.
    sqlx::query("UPDATE inbox_event SET received_at = received_at - interval '1 day'")
        .execute(&db.pool)
        .await
        .unwrap();
    let yesterday = holding(&db.pool).await;
    assert_eq!(yesterday.len(), 1);
    assert_ne!(yesterday, today);

    // Everything delivered again.
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
    settled(&db, &kafka, 200, 100).await;
    running.stop().await;
    assert_eq!(
        paid_counts(&db.pool).await,
        vec![1; 100],
        "each payment applied once"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM inbox_event").await,
        100
    );
    assert_eq!(holding(&db.pool).await, yesterday);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_creates_the_inbox_partition_it_finds_missing() {
    let (db, kafka) = setup().await;
    partitioned(&db.pool).await;
    let payments = orders_with_payments(&db.pool, 200).await;
    let running = Running::consumer(&inbox_consumer(&db, &kafka));
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments[..100])).await;
    settled(&db, &kafka, 100, 100).await;
    // Every partition goes (nothing created them for days, say): receipts find none.
    fixtures::drop_partitions_of(&db.pool, "inbox_event", "true").await;
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments[100..])).await;
    settled(&db, &kafka, 200, 100).await;
    running.stop().await;
    assert_eq!(paid_counts(&db.pool).await, vec![1; 200]);
    let layout = admin::partitions(&db.pool, CleanupTable::Inbox)
        .await
        .unwrap()
        .unwrap();
    assert!(layout.partitions.len() >= 4, "{layout:#?}");
}

/// The `partition_not_dropped` warnings `outbox status` shows.
async fn not_dropped(pool: &PgPool) -> Vec<String> {
    let health = admin::health(pool, &HealthThresholds::default())
        .await
        .unwrap();
    health
        .warnings
        .iter()
        .filter(|w| w.kind() == admin::WarningKind::PartitionNotDropped)
        .map(ToString::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_drops_an_inbox_partition_only_once_every_row_in_it_is_processed() {
    let db = TestDb::new().await;
    partitioned(&db.pool).await;
    // An installation 6 days old, with 100 processed rows a day in each past partition, an
    // unprocessed row 4 days old (waiting for a retry a day away) and a dead row 3 days old.
    fixtures::partitions_since(&db.pool, "inbox_event", 6).await;
    sqlx::raw_sql(
        "INSERT INTO inbox_event (event_id, received_at, payload, processed, processed_at) \
         SELECT gen_random_uuid(), now() - make_interval(days => d), '{}', true, \
                now() - make_interval(days => d) \
         FROM generate_series(1, 5) AS d, generate_series(1, 100); \
         INSERT INTO inbox_event (event_id, received_at, payload, attempts, next_attempt_at) \
         VALUES (gen_random_uuid(), now() - interval '4 days', '{}', 1, now() + interval '1 day'); \
         INSERT INTO inbox_event (event_id, received_at, payload, attempts, last_error, dead_at) \
         VALUES (gen_random_uuid(), now() - interval '3 days', '{}', 5, 'boom', now())",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let of = |days: i32| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT DISTINCT tableoid::regclass::text FROM inbox_event \
                 WHERE received_at::date = (now() - make_interval(days => $1))::date",
            )
            .bind(days)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let (four, three) = (of(4).await, of(3).await);

    // A 2-day window: the partitions that end before it are the first one and those of 6 to 3
    // days ago; those of 4 and 3 days ago hold a row that is not processed.
    let retention = Retention::new(Duration::from_secs(86_400))
        .dedup_older_than(Duration::from_secs(2 * 86_400));
    let report = retention.run_once(&db.pool).await.unwrap().unwrap();
    assert_eq!(
        (
            report.inbox_partitions_dropped,
            report.inbox,
            report.partitions_kept
        ),
        (3, 100 + 200, 2),
        "{report:?}"
    );
    // The kept ones lost their processed rows past the window meanwhile, as a plain table
    // would: one dead row does not keep a day of records.
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM inbox_event").await,
        200 + 2
    );
    let kept = not_dropped(&db.pool).await;
    assert_eq!(kept.len(), 2, "{kept:#?}");
    assert!(
        kept[0].contains(&four) && kept[0].contains("1 unprocessed row"),
        "{kept:#?}"
    );
    assert!(
        kept[1].contains(&three) && kept[1].contains("1 dead row"),
        "{kept:#?}"
    );

    // Its row processed now: the partition waits until that record is past the window too
    // (a replay of the event must not be handled again), unreported.
    sqlx::query("UPDATE inbox_event SET processed = true, processed_at = now() WHERE attempts = 1")
        .execute(&db.pool)
        .await
        .unwrap();
    let report = retention.run_once(&db.pool).await.unwrap().unwrap();
    assert_eq!(
        (
            report.inbox_partitions_dropped,
            report.inbox,
            report.partitions_kept
        ),
        (0, 0, 1),
        "{report:?}"
    );
    let kept = not_dropped(&db.pool).await;
    assert_eq!(kept.len(), 1, "{kept:#?}");
    assert!(kept[0].contains(&three), "{kept:#?}");
    // Three days later (by its record), it goes.
    sqlx::query(
        "UPDATE inbox_event SET processed_at = now() - interval '3 days' WHERE attempts = 1",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let report = retention.run_once(&db.pool).await.unwrap().unwrap();
    assert_eq!(
        (
            report.inbox_partitions_dropped,
            report.inbox,
            report.partitions_kept
        ),
        (1, 1, 1),
        "{report:?}"
    );

    // The dead row's partition, its drop interrupted (a reader outlasted the detach): the
    // next run finishes the detach, finds the dead row, and attaches the partition back.
    let mut reader = db.pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM inbox_event")
        .execute(&mut *reader)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query("SET statement_timeout = '1s'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let interrupted = sqlx::query(&format!(
        "ALTER TABLE inbox_event DETACH PARTITION {three} CONCURRENTLY"
    ))
    .execute(&mut *conn)
    .await;
    assert!(interrupted.is_err(), "the detach waits for the reader");
    drop(conn);
    reader.rollback().await.unwrap();
    let report = retention.run_once(&db.pool).await.unwrap().unwrap();
    assert_eq!(
        (report.inbox_partitions_dropped, report.partitions_kept),
        (0, 1),
        "{report:?}"
    );
    let attached: bool = sqlx::query_scalar(
        "SELECT NOT detach_pending FROM outbox_partitions('inbox_event') \
         WHERE partition::text = $1",
    )
    .bind(&three)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(attached, "{three} attached back");
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM inbox_event WHERE dead_at IS NOT NULL"
        )
        .await,
        1,
        "the dead row is kept, and seen"
    );

    // Discarded by an operator, the dead row settles as a record; its partition goes once
    // that record is past the window.
    let filter = admin::PoisonFilter::all();
    assert_eq!(admin::discard_dead(&db.pool, &filter).await.unwrap(), 1);
    sqlx::query(
        "UPDATE inbox_event SET processed_at = now() - interval '3 days' WHERE attempts = 5",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let report = retention.run_once(&db.pool).await.unwrap().unwrap();
    assert_eq!(
        (report.inbox_partitions_dropped, report.partitions_kept),
        (1, 0),
        "{report:?}"
    );
    assert!(not_dropped(&db.pool).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_inbox_converts_while_a_consumer_runs_losing_nothing() {
    // An installation from before partitions (which has rows in its plain tables).
    let db = TestDb::before_partitions().await;
    fixtures::create_orders(&db.pool).await;
    let kafka = Kafka::mock();
    kafka.create_topic(PAYMENTS, PARTITIONS).await;
    kafka.create_topic(&format!("{PAYMENTS}.dlq"), 1).await;
    let kind: String = sqlx::query_scalar(
        "SELECT relkind::text FROM pg_class WHERE oid = 'inbox_event'::regclass",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(kind, "r");
    // Some payments fail for good: their rows are dead, and stay through the conversion.
    let payments = orders_with_special_payments(&db.pool, 1_500, |i| i % 100 == 0, -1).await;
    let running = Running::consumer(&inbox_consumer(&db, &kafka));
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments[..500])).await;
    settled(&db, &kafka, 500, 495).await;
    // The next 500 arrive while the table converts.
    let producing = {
        let (bootstrap, wave) = (kafka.bootstrap(), records(&payments[500..1_000]));
        tokio::spawn(async move { produce(&bootstrap, PAYMENTS, &wave).await })
    };
    let conversion = admin::convert_to_partitions(&db.pool, CleanupTable::Inbox)
        .await
        .unwrap();
    producing.await.unwrap();
    let Conversion::Converted { history, .. } = &conversion else {
        panic!("{conversion:?}");
    };
    assert_eq!(history, "inbox_event_history");
    // Then the last 500, and the first 500 again: redeliveries of events stored before the
    // conversion, whose rows stayed in the old table, now the first partition.
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments[1_000..])).await;
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments[..500])).await;
    settled(&db, &kafka, 2_000, 1_485).await;
    running.stop().await;

    let paid = paid_counts(&db.pool).await;
    assert_eq!(paid.iter().filter(|&&p| p == 1).count(), 1_485);
    assert!(paid.iter().all(|&p| p <= 1), "each payment applied once");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM inbox_event").await,
        1_500
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM inbox_event WHERE dead_at IS NOT NULL"
        )
        .await,
        15
    );
    let kind: String = sqlx::query_scalar(
        "SELECT relkind::text FROM pg_class WHERE oid = 'inbox_event'::regclass",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(kind, "p");
    assert_eq!(
        admin::convert_to_partitions(&db.pool, CleanupTable::Inbox)
            .await
            .unwrap(),
        Conversion::AlreadyPartitioned
    );
    let layout = admin::partitions(&db.pool, CleanupTable::Inbox)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(layout.partitions[0].name, "inbox_event_history");
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        layout.partitions[0].to.unwrap() >= now + chrono::Duration::days(1),
        "{layout:#?}"
    );
    // The partitions after it have the queue's autovacuum settings, as the old table had.
    let options: Vec<Option<Vec<String>>> = sqlx::query_scalar(
        "SELECT c.reloptions::text[] FROM outbox_partitions('inbox_event') p \
         JOIN pg_class c ON c.oid = p.partition",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(options.len() >= 3, "{options:?}");
    for o in &options {
        let o = o.as_deref().unwrap_or_default();
        assert!(
            o.iter().any(|x| x == "autovacuum_vacuum_threshold=5000"),
            "{options:?}"
        );
    }
    // The partitioned table's indexes, each with the old table's as its first partition's.
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         WHERE i.indrelid = 'inbox_event'::regclass ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        indexes,
        [
            "inbox_event_pkey",
            "ix_inbox_event_dead",
            "ix_inbox_event_key_retrying",
            "ix_inbox_event_pending",
            "ix_inbox_event_shard_pending",
            "ix_inbox_event_unprocessed"
        ]
    );
}

/// The shards held by inbox processors: how many processors hold any, and the shards held by
/// more than one processor (`inbox_event`'s processors are the sessions named
/// `outbox-inbox-processor`; a shard is the second key of a two-key advisory lock, the same
/// for every processor of one inbox).
async fn shard_holders(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "WITH held AS (SELECT l.pid, l.classid, l.objid FROM pg_locks l \
                       JOIN pg_stat_activity a ON a.pid = l.pid \
                       WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
                         AND a.application_name = 'outbox-inbox-processor' \
                         AND a.datname = current_database()) \
         SELECT (SELECT count(DISTINCT pid) FROM held), \
                (SELECT count(*) FROM (SELECT objid FROM held GROUP BY objid \
                                       HAVING count(DISTINCT pid) > 1) twice)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processors_started_before_and_after_a_conversion_share_the_keys_shards() {
    // Failed before the fix: the processors locked their shards under the table's oid, which
    // the conversion changes, so a consumer started after it counted only its own processors
    // and took every shard that those started before held too (one key, two processors).
    let db = TestDb::before_partitions().await;
    fixtures::create_orders(&db.pool).await;
    let kafka = Kafka::mock();
    kafka.create_topic(PAYMENTS, PARTITIONS).await;
    kafka.create_topic(&format!("{PAYMENTS}.dlq"), 1).await;
    let consumer = |kafka: &Kafka| {
        builder(&db, kafka, "orders")
            .handler(fixtures::mark_order_paid)
            .mode(Mode::Inbox)
            .processors(2)
            .poll_interval(Duration::from_millis(20))
            .build()
            .unwrap()
    };
    let before = Running::consumer(&consumer(&kafka));
    let processors = || async { admin::status(&db.pool).await.unwrap().inbox_processors };
    wait_for("two processors", Duration::from_secs(30), || async {
        processors().await == 2
    })
    .await;
    let conversion = admin::convert_to_partitions(&db.pool, CleanupTable::Inbox)
        .await
        .unwrap();
    assert!(
        matches!(conversion, Conversion::Converted { .. }),
        "{conversion:?}"
    );
    let after = Running::consumer(&consumer(&kafka));
    // All four count, and once the shares settle every shard has one holder among them.
    wait_for(
        "four processors counted, each holding a share, no shard held twice",
        Duration::from_secs(30),
        || async { processors().await == 4 && shard_holders(&db.pool).await == (4, 0) },
    )
    .await;
    // And they process: a payment sent now is applied once.
    let payments = orders_with_payments(&db.pool, 200).await;
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
    settled(&db, &kafka, 200, 200).await;
    assert!(paid_counts(&db.pool).await.iter().all(|&p| p == 1));
    Running::stop_all([before, after]).await;
}
