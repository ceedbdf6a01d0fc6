//! `cleanup`: exactly the rows past the retention, while a relay publishes.

use std::collections::HashSet;
use std::time::Duration;

use outbox_runtime::relay::Relay;
use outbox_tests::kafka::Kafka;
use outbox_tests::{Running, TestDb};

use crate::support::{
    assert_error, assert_ok, count, emit_posted, insert_rows, run, stdout, TOPIC,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_removes_exactly_the_rows_past_the_cutoff_while_a_relay_publishes() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    // Daily dedup partitions back 45 days: those that end before the cut-off go whole.
    outbox_tests::fixtures::dedup_partitions_since(pool, 45).await;
    let old_published = insert_rows(pool, TOPIC, 500, "41 days", Some("40 days"), false).await;
    insert_rows(pool, TOPIC, 100, "11 days", Some("10 days"), false).await;
    insert_rows(pool, TOPIC, 20, "60 days", None, true).await;
    // Old but unpublished: the relay publishes them now, so they are young published rows.
    insert_rows(pool, TOPIC, 30, "60 days", None, false).await;
    outbox_tests::fixtures::insert_dedup_records(pool).await;
    let before: HashSet<i64> = sqlx::query_scalar("SELECT id FROM outbox_event")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect();

    let dry = run(&db.url, &["cleanup", "--older-than", "30d", "--dry-run"]).await;
    assert_ok(&dry);
    let text = stdout(&dry);
    for expected in [
        "would delete 570 rows",
        "500 from outbox_event (before ",
        "30 from inbox_event (before ",
        "40 from processed_event (before ",
    ] {
        assert!(text.contains(expected), "{expected}: {text}");
    }
    // A longer retention for the dedup records: 35 days keeps the 31-day-old processed_event
    // rows, not the 40-day-old inbox rows.
    let dedup = run(
        &db.url,
        &[
            "cleanup",
            "--older-than",
            "30d",
            "--dedup-older-than",
            "35d",
            "--dry-run",
        ],
    )
    .await;
    assert_ok(&dedup);
    let text = stdout(&dedup);
    for expected in [
        "would delete 530 rows",
        "500 from outbox_event",
        "30 from inbox_event",
        "0 from processed_event",
    ] {
        assert!(text.contains(expected), "{expected}: {text}");
    }
    let refused = run(&db.url, &["cleanup", "--older-than", "30d"]).await;
    assert_error(&refused, "pass --yes");
    assert_eq!(
        count(pool, "SELECT count(*) FROM outbox_event").await,
        before.len() as i64
    );

    // A relay publishes while new events keep coming, and the cleanup runs.
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 4).await;
    let relay = Relay::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .poll_interval(Duration::from_millis(50))
        .build()
        .unwrap();
    let relay_task = Running::relay(&relay);
    let writer = {
        let pool = db.pool.clone();
        let cancel = relay_task.token();
        tokio::spawn(async move {
            let mut n = 0;
            while !cancel.is_cancelled() && n < 3_000 {
                n += emit_posted(&pool, 20, 5).await;
            }
            n
        })
    };
    let out = run(
        &db.url,
        &["cleanup", "--older-than", "30d", "--batch", "37", "--yes"],
    )
    .await;
    assert_ok(&out);
    let text = stdout(&out);
    assert!(text.contains("outbox_event: deleted 500 rows"), "{text}");
    assert!(text.contains("inbox_event: deleted 30 rows"), "{text}");
    assert!(text.contains("processed_event: deleted 40 rows"), "{text}");
    let written = writer.await.unwrap();
    // Everything left gets published, then the relay stops.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(
        pool,
        "SELECT count(*) FROM outbox_event WHERE published_at IS NULL AND parked_at IS NULL",
    )
    .await
        > 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "relay did not drain"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay_task.stop().await;

    let after: HashSet<i64> = sqlx::query_scalar("SELECT id FROM outbox_event")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    let removed: HashSet<i64> = before.difference(&after).copied().collect();
    assert_eq!(removed, old_published.into_iter().collect::<HashSet<_>>());
    assert_eq!(after.len(), before.len() - 500 + written);
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM outbox_event WHERE parked_at IS NOT NULL"
        )
        .await,
        20
    );
    assert_eq!(
        count(pool, "SELECT count(*) FROM inbox_event WHERE processed").await,
        0
    );
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM inbox_event WHERE dead_at IS NOT NULL"
        )
        .await,
        5
    );
    assert_eq!(count(pool, "SELECT count(*) FROM inbox_event").await, 15);
    assert_eq!(
        count(pool, "SELECT count(*) FROM processed_event").await,
        15
    );

    let nothing = run(&db.url, &["cleanup", "--older-than", "30d", "--yes"]).await;
    assert_ok(&nothing);
    assert!(
        stdout(&nothing).contains("nothing deleted"),
        "{}",
        stdout(&nothing)
    );
}
