//! Consumers against real PostgreSQL and the mock cluster: exactly-once effects over
//! at-least-once delivery, dead letters, retries, the inbox and its processors.

use std::time::Duration;

use outbox_runtime::inbox::{Consumer, ConsumerBuilder, Mode};
use outbox_tests::fixtures::{self, PaymentRefunded, PaymentSucceeded, PAYMENTS};
use outbox_tests::kafka::{committed_total, consume, produce, Kafka, Outgoing};
use outbox_tests::TestDb;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const PARTITIONS: i32 = 4;

fn builder(db: &TestDb, kafka: &Kafka, group: &str) -> ConsumerBuilder {
    let mut config = rdkafka::ClientConfig::new();
    config.set("auto.commit.interval.ms", "100");
    Consumer::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .group_id(group)
        .consumer_config(config)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
}

/// `n` orders, each with its payment event.
async fn orders_with_payments(pool: &PgPool, n: usize) -> Vec<(Uuid, PaymentSucceeded)> {
    let orders: Vec<Uuid> = (0..n).map(|_| Uuid::now_v7()).collect();
    fixtures::insert_orders(pool, &orders).await;
    orders
        .into_iter()
        .map(|order_id| {
            let event = PaymentSucceeded {
                payment_id: Uuid::now_v7(),
                order_id,
                amount: 100,
            };
            (Uuid::now_v7(), event)
        })
        .collect()
}

/// Polls `condition` until it holds; panics with `what` after `timeout`.
async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn paid_counts(pool: &PgPool) -> Vec<i32> {
    sqlx::query_scalar("SELECT paid FROM orders ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn setup() -> (TestDb, Kafka) {
    let db = TestDb::new().await;
    fixtures::create_orders(&db.pool).await;
    let kafka = Kafka::mock();
    kafka.create_topic(PAYMENTS, PARTITIONS).await;
    kafka.create_topic(&format!("{PAYMENTS}.dlq"), 1).await;
    (db, kafka)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_delivered_twice_takes_effect_once() {
    let (db, kafka) = setup().await;
    let payments = orders_with_payments(&db.pool, 100).await;
    let refunds: Vec<(Uuid, PaymentRefunded)> = payments
        .iter()
        .take(10)
        .map(|(_, p)| {
            let refund = PaymentRefunded {
                payment_id: p.payment_id,
                order_id: p.order_id,
            };
            (Uuid::now_v7(), refund)
        })
        .collect();
    let mut records: Vec<Outgoing> = payments
        .iter()
        .map(|(id, e)| Outgoing::event(e, *id))
        .collect();
    records.extend(refunds.iter().map(|(id, e)| Outgoing::event(e, *id)));
    // Everything once, then everything again in the opposite order.
    let mut twice = records.clone();
    twice.extend(records.iter().rev().cloned());
    produce(&kafka.bootstrap(), PAYMENTS, &twice).await;

    let consumer = builder(&db, &kafka, "orders")
        .handler(fixtures::mark_order_paid)
        .handler(fixtures::mark_order_refunded)
        .build()
        .unwrap();
    let cancel = CancellationToken::new();
    let handle = consumer.spawn(cancel.clone());
    let total = twice.len() as i64;
    wait_for(
        "all messages consumed and committed",
        Duration::from_secs(60),
        || async { committed_total(&kafka.bootstrap(), "orders", PAYMENTS, PARTITIONS) == total },
    )
    .await;
    cancel.cancel();
    handle.await.unwrap().unwrap();

    assert_eq!(
        paid_counts(&db.pool).await,
        vec![1; 100],
        "each payment applied once"
    );
    let refunded: i64 = sqlx::query_scalar("SELECT sum(refunded) FROM orders")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(refunded, 10);
    let ledger: Vec<(String, i64)> = sqlx::query_as(
        "SELECT handler, count(*) FROM processed_event GROUP BY handler ORDER BY handler",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        ledger,
        [
            ("mark_order_paid".to_owned(), 100),
            ("mark_order_refunded".to_owned(), 10)
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_go_to_the_dead_letter_topic_and_the_partition_flows() {
    let (db, kafka) = setup().await;
    let payments = orders_with_payments(&db.pool, 2).await;
    let key = "one-partition".to_owned();
    let good = |i: usize| {
        let mut r = Outgoing::event(&payments[i].1, payments[i].0);
        r.key = key.clone();
        r
    };
    let mut not_json = good(0);
    not_json.payload = b"{not json".to_vec();
    not_json.headers[0].1 = Uuid::now_v7().to_string();
    let mut no_event_id = good(0);
    no_event_id.headers.remove(0);
    let mut wrong_shape = good(0);
    wrong_shape.payload = br#"{"payment_id": "not-a-uuid"}"#.to_vec();
    wrong_shape.headers[0].1 = Uuid::now_v7().to_string();
    let negative = PaymentSucceeded {
        amount: -5,
        ..payments[0].1.clone()
    };
    let mut refused = Outgoing::event(&negative, Uuid::now_v7());
    refused.key = key.clone();
    // All on one partition; the good ones around the poison must still be handled.
    let records = vec![
        good(0),
        not_json,
        no_event_id,
        wrong_shape,
        refused,
        good(1),
    ];
    produce(&kafka.bootstrap(), PAYMENTS, &records).await;

    let consumer = builder(&db, &kafka, "orders")
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let cancel = CancellationToken::new();
    let handle = consumer.spawn(cancel.clone());
    let dead = consume(
        &kafka.bootstrap(),
        &format!("{PAYMENTS}.dlq"),
        1,
        Duration::from_secs(30),
        |r| r.len() >= 4,
    )
    .await;
    wait_for(
        "the partition consumed",
        Duration::from_secs(30),
        || async { committed_total(&kafka.bootstrap(), "orders", PAYMENTS, PARTITIONS) == 6 },
    )
    .await;
    cancel.cancel();
    handle.await.unwrap().unwrap();

    assert_eq!(
        paid_counts(&db.pool).await.iter().sum::<i32>(),
        2,
        "both good ones applied"
    );
    let errors: Vec<&str> = dead.iter().map(|r| r.header("dlq_error")).collect();
    assert_eq!(dead.len(), 4, "{errors:?}");
    assert!(
        errors[0].starts_with("payload is not JSON"),
        "{}",
        errors[0]
    );
    assert_eq!(errors[1], "message has no event_id header");
    assert!(
        errors[2].contains("does not deserialize into `outbox_tests::fixtures::PaymentSucceeded`"),
        "{}",
        errors[2]
    );
    assert!(
        errors[3].contains("handler `mark_order_paid` failed for good: negative amount -5"),
        "{}",
        errors[3]
    );
    for (r, original) in dead.iter().zip(&records[1..5]) {
        assert_eq!(r.key, original.key);
        assert_eq!(r.raw, original.payload);
        assert_eq!(r.header("dlq_source_topic"), PAYMENTS);
        for (k, v) in &original.headers {
            assert_eq!(r.header(k), v, "original header {k} kept");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_handler_failing_twice_then_succeeding_takes_effect_once() {
    let (db, kafka) = setup().await;
    let payments = orders_with_payments(&db.pool, 1).await;
    let records: Vec<Outgoing> = payments
        .iter()
        .map(|(id, e)| Outgoing::event(e, *id))
        .collect();
    produce(&kafka.bootstrap(), PAYMENTS, &records).await;
    let consumer = builder(&db, &kafka, "orders")
        .handler(fixtures::flaky_mark_paid)
        .mode(Mode::Inbox)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let cancel = CancellationToken::new();
    let handle = consumer.spawn(cancel.clone());
    wait_for("the row processed", Duration::from_secs(30), || async {
        sqlx::query_scalar("SELECT processed FROM inbox_event")
            .fetch_optional(&db.pool)
            .await
            .unwrap()
            .unwrap_or(false)
    })
    .await;
    cancel.cancel();
    handle.await.unwrap().unwrap();
    let (attempts, last_error): (i32, Option<String>) =
        sqlx::query_as("SELECT attempts, last_error FROM inbox_event")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(attempts, 2, "two failed attempts recorded");
    assert!(last_error.unwrap().contains("the payment service is busy"));
    assert_eq!(
        paid_counts(&db.pool).await,
        [1],
        "failed attempts left nothing behind"
    );
    assert_eq!(
        fixtures::FLAKY_CALLS.load(std::sync::atomic::Ordering::SeqCst),
        3
    );
}
