//! Poison rows: parked outbox events and dead inbox rows (list, retry, drop), and a drop racing
//! a retry.

use std::time::Duration;

use outbox_runtime::inbox::{Consumer, Mode};
use outbox_runtime::relay::Relay;
use outbox_runtime::OutboxEvent;
use outbox_tests::fixtures::{create_orders, insert_orders, mark_order_paid, PaymentSucceeded};
use outbox_tests::kafka::Kafka;
use outbox_tests::TestDb;
use uuid::Uuid;

use crate::support::{assert_error, assert_ok, count, insert_rows, run, stdout, TOPIC};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_events_are_listed_retried_and_dropped() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 2).await;
    kafka.create_topic("other.events", 2).await;
    let ours = insert_rows(pool, TOPIC, 2, "1 hour", None, true).await;
    let other = insert_rows(pool, "other.events", 1, "1 hour", None, true).await;

    let list = run(&db.url, &["parked", "list"]).await;
    assert_ok(&list);
    let text = stdout(&list);
    assert_eq!(
        text.lines()
            .filter(|l| l.contains("Message size too large"))
            .count(),
        3,
        "{text}"
    );
    let json = run(&db.url, &["parked", "list", "--topic", TOPIC, "--json"]).await;
    assert_ok(&json);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&stdout(&json)).unwrap();
    let ids: Vec<i64> = rows.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(ids, ours);
    assert_eq!(rows[0]["attempts"], 5);
    assert_eq!(rows[0]["payload"]["seq"], 1);

    assert_error(&run(&db.url, &["parked", "retry"]).await, "say which rows");
    assert_error(
        &run(&db.url, &["parked", "retry", "--topic", TOPIC]).await,
        "pass --yes",
    );
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM outbox_event WHERE parked_at IS NOT NULL"
        )
        .await,
        3
    );

    let retry = run(&db.url, &["parked", "retry", "--topic", TOPIC, "--yes"]).await;
    assert_ok(&retry);
    assert!(
        stdout(&retry).contains("un-parked 2 events"),
        "{}",
        stdout(&retry)
    );
    let reset: i64 = count(
        pool,
        "SELECT count(*) FROM outbox_event WHERE parked_at IS NULL AND attempts = 0 \
         AND next_attempt_at <= now() AND published_at IS NULL",
    )
    .await;
    assert_eq!(reset, 2);
    // The relay publishes the retried rows, and not the one still parked.
    let relay = Relay::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .build()
        .unwrap();
    assert_eq!(relay.publish_pending().await.unwrap(), 2);
    let published: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM outbox_event WHERE published_at IS NOT NULL ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(published, ours);

    let event_id: Uuid = sqlx::query_scalar("SELECT event_id FROM outbox_event WHERE id = $1")
        .bind(other[0])
        .fetch_one(pool)
        .await
        .unwrap();
    assert_error(
        &run(&db.url, &["parked", "drop", "--id", "x1", "--yes"]).await,
        "invalid --id `x1`",
    );
    let dropped = run(
        &db.url,
        &["parked", "drop", "--id", &event_id.to_string(), "--yes"],
    )
    .await;
    assert_ok(&dropped);
    assert!(
        stdout(&dropped).contains("dropped 1 parked events"),
        "{}",
        stdout(&dropped)
    );
    assert_eq!(count(pool, "SELECT count(*) FROM outbox_event").await, 2);
    let empty = run(&db.url, &["parked", "drop", "--all", "--yes"]).await;
    assert_ok(&empty);
    assert!(
        stdout(&empty).contains("nothing changed"),
        "{}",
        stdout(&empty)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_inbox_rows_are_listed_and_retried() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    create_orders(pool).await;
    let orders: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
    insert_orders(pool, &orders).await;
    for order_id in &orders {
        let event = PaymentSucceeded {
            payment_id: Uuid::now_v7(),
            order_id: *order_id,
            amount: 100,
        };
        sqlx::query(
            "INSERT INTO inbox_event (event_id, topic, event_type, partition_key, payload, \
                 attempts, last_error, dead_at) \
             VALUES ($1, $2, $3, $4, $5, 5, 'handler `mark_order_paid` failed: deadlock', now())",
        )
        .bind(Uuid::new_v4())
        .bind(PaymentSucceeded::TOPIC)
        .bind(PaymentSucceeded::EVENT_TYPE)
        .bind(event.partition_key())
        .bind(serde_json::to_value(&event).unwrap())
        .execute(pool)
        .await
        .unwrap();
    }
    let list = run(&db.url, &["inbox", "dead", "list", "--limit", "2"]).await;
    assert_ok(&list);
    let text = stdout(&list);
    assert_eq!(
        text.lines().filter(|l| l.contains("deadlock")).count(),
        2,
        "{text}"
    );
    assert!(text.contains("there may be more"), "{text}");
    assert_error(
        &run(&db.url, &["inbox", "dead", "retry", "--id", "7", "--yes"]).await,
        "expected an event id (UUID)",
    );

    let retry = run(&db.url, &["inbox", "dead", "retry", "--all", "--yes"]).await;
    assert_ok(&retry);
    assert!(
        stdout(&retry).contains("revived 3 dead inbox rows"),
        "{}",
        stdout(&retry)
    );
    // The inbox processor handles them now.
    let kafka = Kafka::mock();
    let consumer = Consumer::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .group_id("cli-test")
        .handler(mark_order_paid)
        .mode(Mode::Inbox)
        .build()
        .unwrap();
    assert_eq!(consumer.process_inbox_pending().await.unwrap(), 3);
    assert_eq!(
        count(pool, "SELECT count(*) FROM orders WHERE paid = 1").await,
        3
    );
    assert_eq!(
        count(pool, "SELECT count(*) FROM inbox_event WHERE processed").await,
        3
    );
}

/// An operator drops parked rows while another retries one of them: the drop waits for the
/// retry's row lock, then must see that the row is no longer parked, and leave it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drop_never_deletes_a_row_retried_meanwhile() {
    use outbox_runtime::admin::{drop_parked, PoisonFilter};

    let db = TestDb::new().await;
    let ids = insert_rows(&db.pool, TOPIC, 2, "1 hour", None, true).await;
    let mut retry = db.pool.begin().await.unwrap();
    sqlx::query("UPDATE outbox_event SET parked_at = NULL, attempts = 0 WHERE id = $1")
        .bind(ids[0])
        .execute(&mut *retry)
        .await
        .unwrap();
    let dropper = {
        let pool = db.pool.clone();
        tokio::spawn(async move { drop_parked(&pool, &PoisonFilter::all()).await })
    };
    // Wait until the drop is blocked on the retried row's lock.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while count(
        &db.pool,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND wait_event_type = 'Lock' AND query LIKE 'DELETE FROM outbox_event%'",
    )
    .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the drop never waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    retry.commit().await.unwrap();
    assert_eq!(
        dropper.await.unwrap().unwrap(),
        1,
        "only the row still parked"
    );
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox_event")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, vec![ids[0]]);
}
