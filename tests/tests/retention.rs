//! Retention on a schedule (`admin::Retention`, what a relay runs beside publishing): exactly
//! the rows past their retention go, one run at a time per database, and bad settings are
//! refused.

use std::time::Duration;

use outbox_runtime::admin::{Retention, RetentionReport};
use outbox_runtime::relay::Relay;
use outbox_tests::kafka::Kafka;
use outbox_tests::{count, fixtures, Running, TestDb};
use sqlx::PgPool;

const DAY: u64 = 86_400;

/// Rows of every kind, old and young: 50 published 40 days ago, 10 published 10 days ago, 5
/// parked and 5 unpublished 60 days old; inbox rows processed 40 days ago (30), unprocessed
/// (10), dead (5); `processed_event` rows 31 days old (40) and 29 (15).
async fn fill(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
             topic, partition_key, created_at, published_at, parked_at) \
         SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 'r.events', 'k' || i, \
             now() - interval '60 days', \
             CASE WHEN i <= 50 THEN now() - interval '40 days' \
                  WHEN i <= 60 THEN now() - interval '10 days' END, \
             CASE WHEN i > 65 THEN now() - interval '50 days' END \
         FROM generate_series(1, 70) AS i",
    )
    .execute(pool)
    .await
    .unwrap();
    fixtures::insert_dedup_records(pool).await;
}

async fn left(pool: &PgPool) -> [i64; 3] {
    [
        count(pool, "SELECT count(*) FROM outbox_event").await,
        count(pool, "SELECT count(*) FROM inbox_event").await,
        count(pool, "SELECT count(*) FROM processed_event").await,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_run_at_a_time_deletes_exactly_what_is_past_the_retention() {
    // An installation from before partitions: processed_event rows are deleted.
    one_run_at_a_time(TestDb::before_partitions().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_run_at_a_time_drops_the_dedup_partitions_past_the_retention() {
    // A partitioned installation 40 days old: the daily partitions that end before the
    // cut-off go whole, the rows 31 days old with them; the one of the rows 29 days old stays.
    let db = TestDb::new().await;
    fixtures::dedup_partitions_since(&db.pool, 40).await;
    let report = one_run_at_a_time(db).await;
    // The first partition (before 40 days ago) and the days from 40 to 31 days ago.
    assert_eq!(report.processed_event_partitions_dropped, 11, "{report:?}");
}

/// Runs retention on `db` twice, the first time while another instance holds the lock; returns
/// the report of the run that cut.
async fn one_run_at_a_time(db: TestDb) -> RetentionReport {
    let pool = &db.pool;
    fill(pool).await;
    let retention = Retention::new(Duration::from_secs(30 * DAY));

    // Another instance is running it: this one skips its turn and deletes nothing.
    let mut other = pool.begin().await.unwrap();
    let space: i64 = sqlx::query_scalar("SELECT 'outbox_event'::regclass::oid::int8")
        .fetch_one(&mut *other)
        .await
        .unwrap();
    let held: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1, $2)")
        .bind(space as u32 as i32)
        .bind(0x5200_0000_i32)
        .fetch_one(&mut *other)
        .await
        .unwrap();
    assert!(held);
    assert_eq!(retention.run_once(pool).await.unwrap(), None);
    assert_eq!(left(pool).await, [70, 45, 55]);
    other.rollback().await.unwrap();

    // Its turn: the 50 old published rows, the 30 old processed inbox rows and the 40 old
    // dedup records; never the unpublished, parked, unprocessed or dead ones.
    let report = retention.run_once(pool).await.unwrap().unwrap();
    assert_eq!(
        (report.outbox, report.inbox, report.processed_event),
        (50, 30, 40)
    );
    assert_eq!(left(pool).await, [20, 15, 15]);
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM outbox_event WHERE published_at IS NULL"
        )
        .await,
        10
    );
    // Nothing more the second time; the lock went with the run.
    assert_eq!(
        retention.run_once(pool).await.unwrap(),
        Some(RetentionReport::default())
    );
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_runs_retention_beside_publishing_with_a_longer_dedup_window() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    fill(pool).await;
    let kafka = Kafka::mock();
    kafka.create_topic("r.events", 2).await;
    let relay = Relay::builder(pool.clone())
        .brokers(kafka.bootstrap())
        .retention(
            Retention::new(Duration::from_secs(30 * DAY))
                .dedup_older_than(Duration::from_secs(35 * DAY)),
        )
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    // The relay publishes the 5 unpublished rows (young published rows then) and runs
    // retention once at its start: the old published rows and inbox rows go; the dedup
    // records are 31 days old, inside the 35-day window, and stay.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while left(pool).await != [20, 15, 55]
        || count(
            pool,
            "SELECT count(*) FROM outbox_event WHERE published_at IS NULL AND parked_at IS NULL",
        )
        .await
            != 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "left: {:?}",
            left(pool).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.stop().await;
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM outbox_event WHERE parked_at IS NOT NULL"
        )
        .await,
        5
    );
}

#[tokio::test]
async fn retention_settings_that_cannot_work_are_refused() {
    let db = TestDb::new().await;
    let shorter = Retention::new(Duration::from_secs(30 * DAY))
        .dedup_older_than(Duration::from_secs(7 * DAY));
    let err = shorter.run_once(&db.pool).await.unwrap_err().to_string();
    assert!(
        err.contains("dedup_older_than (604800s) is shorter than older_than (2592000s)"),
        "{err}"
    );
    let typo = Retention::new(Duration::from_secs(30))
        .run_once(&db.pool)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        typo.contains("retention shorter than a minute (30s; dedup None)"),
        "{typo}"
    );
    let build = Relay::builder(db.pool.clone())
        .brokers("127.0.0.1:9")
        .retention(Retention::new(Duration::from_secs(DAY)).every(Duration::from_millis(10)))
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        build.contains("retention must run at least a second apart, not every 10ms"),
        "{build}"
    );
}
