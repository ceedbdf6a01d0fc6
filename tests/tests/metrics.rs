//! The metrics the relay and the consumer report, read back through a recording `metrics`
//! recorder (its own test binary: the recorder is process-wide).

use std::collections::HashMap;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;
use outbox_runtime::inbox::Consumer;
use outbox_runtime::relay::Relay;
use outbox_runtime::Uow;
use outbox_tests::fixtures::{self, PaymentSucceeded, PAYMENTS};
use outbox_tests::kafka::{produce, Kafka, Outgoing};
use outbox_tests::{Running, TestDb};
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_report_their_counters_and_gauges() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");
    let read = || -> HashMap<(MetricKind, String), f64> {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let value = match value {
                    DebugValue::Counter(c) => c as f64,
                    DebugValue::Gauge(g) => g.into_inner(),
                    DebugValue::Histogram(h) => h.len() as f64,
                };
                ((key.kind(), key.key().name().to_owned()), value)
            })
            .collect()
    };

    let db = TestDb::new().await;
    fixtures::create_orders(&db.pool).await;
    let kafka = Kafka::mock();
    kafka.create_topic(PAYMENTS, 2).await;

    // The relay publishes 20 events.
    let orders: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    fixtures::insert_orders(&db.pool, &orders).await;
    let events: Vec<PaymentSucceeded> = orders
        .iter()
        .map(|&order_id| PaymentSucceeded {
            payment_id: Uuid::now_v7(),
            order_id,
            amount: 1,
        })
        .collect();
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit_all(&events).await.unwrap();
    uow.commit().await.unwrap();
    let relay = Relay::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .build()
        .unwrap();
    let relay = Running::relay(&relay);

    // A consumer gets them, and one of them once more.
    let consumer = Consumer::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .group_id("metrics")
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let consumer = Running::consumer(&consumer);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let counter = |name: &str| read().get(&(MetricKind::Counter, name.to_owned())).copied();
    while counter("outbox_consumer_processed_total") < Some(20.0) {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", read());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let event_id: Uuid = sqlx::query_scalar("SELECT event_id FROM outbox_event LIMIT 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let event: PaymentSucceeded = serde_json::from_value(
        sqlx::query_scalar("SELECT payload FROM outbox_event WHERE event_id = $1")
            .bind(event_id)
            .fetch_one(&db.pool)
            .await
            .unwrap(),
    )
    .unwrap();
    produce(
        &kafka.bootstrap(),
        PAYMENTS,
        &[Outgoing::event(&event, event_id)],
    )
    .await;
    while counter("outbox_consumer_duplicates_total") < Some(1.0) {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", read());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Running::stop_all([relay, consumer]).await;

    let m = read();
    assert_eq!(
        m[&(MetricKind::Counter, "outbox_relay_published_total".into())],
        20.0
    );
    assert_eq!(
        m[&(
            MetricKind::Counter,
            "outbox_consumer_processed_total".into()
        )],
        20.0
    );
    assert_eq!(
        m[&(
            MetricKind::Counter,
            "outbox_consumer_duplicates_total".into()
        )],
        1.0
    );
    // Reported when the relay started, before it published anything.
    assert_eq!(m[&(MetricKind::Gauge, "outbox_relay_backlog".into())], 20.0);
    assert!(
        m[&(
            MetricKind::Gauge,
            "outbox_relay_oldest_unpublished_age_seconds".into()
        )] >= 0.0
    );
    // (Histogram samples are drained by every snapshot, so they are not checked here.)
}
