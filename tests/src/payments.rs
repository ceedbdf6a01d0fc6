//! What the consumer tests share: a consumer builder for the payments topic, orders with their
//! payment events, reading the retry and dead-letter topics, and waiting for a condition.

use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;
use outbox_runtime::inbox::{Consumer, ConsumerBuilder};
use rdkafka::ClientConfig;
use sqlx::PgPool;
use uuid::Uuid;

use crate::fixtures::{self, PaymentSucceeded, PAYMENTS};
use crate::kafka::{consume, produce, Kafka, Outgoing, Received};
use crate::TestDb;

/// Partitions of the payments topic.
pub const PARTITIONS: i32 = 4;

pub fn builder(db: &TestDb, kafka: &Kafka, group: &str) -> ConsumerBuilder {
    let mut config = ClientConfig::new();
    config.set("auto.commit.interval.ms", "100");
    Consumer::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .group_id(group)
        .consumer_config(config)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
}

/// `n` orders, each with its payment event.
pub async fn orders_with_payments(pool: &PgPool, n: usize) -> Vec<(Uuid, PaymentSucceeded)> {
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

/// [`orders_with_payments`], with `amount` instead of 100 on the payments whose index `picked`
/// picks (an amount some handlers of [`fixtures`] react to).
pub async fn orders_with_special_payments(
    pool: &PgPool,
    n: usize,
    picked: impl Fn(usize) -> bool,
    amount: i64,
) -> Vec<(Uuid, PaymentSucceeded)> {
    let mut payments = orders_with_payments(pool, n).await;
    for (i, (_, payment)) in payments.iter_mut().enumerate() {
        if picked(i) {
            payment.amount = amount;
        }
    }
    payments
}

pub fn records(payments: &[(Uuid, PaymentSucceeded)]) -> Vec<Outgoing> {
    payments
        .iter()
        .map(|(id, e)| Outgoing::event(e, *id))
        .collect()
}

/// Produces every payment's record under one key, so that they are one partition's, read in
/// order and in shared batches; returns them.
pub async fn produce_in_one_partition(
    kafka: &Kafka,
    payments: &[(Uuid, PaymentSucceeded)],
) -> Vec<Outgoing> {
    let all: Vec<Outgoing> = records(payments)
        .into_iter()
        .map(|mut r| {
            r.key = "one-partition".into();
            r
        })
        .collect();
    produce(&kafka.bootstrap(), PAYMENTS, &all).await;
    all
}

/// Produces the payments as the relay would.
pub async fn publish(kafka: &Kafka, payments: &[(Uuid, PaymentSucceeded)]) {
    produce(&kafka.bootstrap(), PAYMENTS, &records(payments)).await;
}

/// What was sent to the payments' retry topic: read for 2 s, or until more than `expected` came
/// (so that one too many shows).
pub async fn retried(kafka: &Kafka, expected: usize) -> Vec<Received> {
    consume(
        &kafka.bootstrap(),
        &format!("{PAYMENTS}.retry"),
        PARTITIONS,
        Duration::from_secs(2),
        |r| r.len() > expected,
    )
    .await
}

/// Where each of the `n` payments on the payments' topic was read: its partition and offset
/// (as a retry or dead-letter header spells them), by its `event_id`.
pub async fn read_at(
    kafka: &Kafka,
    n: usize,
) -> std::collections::HashMap<String, (String, String)> {
    consume(
        &kafka.bootstrap(),
        PAYMENTS,
        PARTITIONS,
        Duration::from_secs(10),
        |r| r.len() == n,
    )
    .await
    .into_iter()
    .map(|r| {
        let at = (r.partition.to_string(), r.offset.to_string());
        (r.header("event_id").to_owned(), at)
    })
    .collect()
}

/// The payments' dead letters: read until `n` came, or `timeout` passed.
pub async fn dead_letters(kafka: &Kafka, n: usize, timeout: Duration) -> Vec<Received> {
    consume(
        &kafka.bootstrap(),
        &format!("{PAYMENTS}.dlq"),
        1,
        timeout,
        |r| r.len() >= n,
    )
    .await
}

/// Polls `condition` until it holds; panics with `what` after `timeout`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut condition: F)
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

pub async fn paid_counts(pool: &PgPool) -> Vec<i32> {
    sqlx::query_scalar("SELECT paid FROM orders ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

pub async fn setup() -> (TestDb, Kafka) {
    setup_on(Kafka::mock()).await
}

pub async fn setup_on(kafka: Kafka) -> (TestDb, Kafka) {
    let (db, kafka) = setup_without_dead_letter_topic(kafka).await;
    kafka.create_topic(&format!("{PAYMENTS}.dlq"), 1).await;
    (db, kafka)
}

/// [`setup_on`] but for the dead-letter topic, which a test of a missing one creates later.
pub async fn setup_without_dead_letter_topic(kafka: Kafka) -> (TestDb, Kafka) {
    let db = TestDb::new().await;
    fixtures::create_orders(&db.pool).await;
    kafka.create_topic(PAYMENTS, PARTITIONS).await;
    kafka
        .create_topic(&format!("{PAYMENTS}.retry"), PARTITIONS)
        .await;
    (db, kafka)
}

/// Producer settings for a consumer's retry and dead-letter sends to a broker that creates no
/// topic on first use: a send to a missing topic blocks, and a topic created meanwhile is seen
/// within a second.
pub fn no_auto_created_topics() -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("allow.auto.create.topics", "false")
        .set("topic.metadata.propagation.max.ms", "1000");
    config
}

/// A record for the payments topic that is not JSON (nor has any header): a dead letter.
pub fn not_json() -> Outgoing {
    Outgoing {
        key: "k".into(),
        payload: b"not json".to_vec(),
        headers: Vec::new(),
    }
}

/// Installs this test process's metrics recorder (one per test binary) and returns a reader of
/// the gauge `outbox_consumer_forward_blocked`: of `topic`, or of any topic if `None`.
pub fn forward_blocked_gauge(topic: Option<String>) -> impl Fn() -> Option<f64> {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");
    move || {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .find(|(key, _, _, _)| {
                key.kind() == MetricKind::Gauge
                    && key.key().name() == "outbox_consumer_forward_blocked"
                    && topic.as_deref().is_none_or(|topic| {
                        key.key()
                            .labels()
                            .any(|l| l.key() == "topic" && l.value() == topic)
                    })
            })
            .map(|(_, _, _, value)| match value {
                DebugValue::Gauge(g) => g.into_inner(),
                other => panic!("not a gauge: {other:?}"),
            })
    }
}
