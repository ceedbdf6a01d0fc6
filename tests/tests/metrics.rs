//! The metrics the relay and the consumer report, read back through a recording `metrics`
//! recorder, and the relay's health warnings in its log (their own test binary: the recorder and
//! the log's subscriber are process-wide).

use std::collections::HashMap;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;
use outbox_runtime::inbox::Consumer;
use outbox_runtime::relay::Relay;
use outbox_runtime::Uow;
use outbox_tests::fixtures::{self, PaymentSucceeded, PAYMENTS};
use outbox_tests::kafka::{produce, Kafka, Outgoing};
use outbox_tests::log::Log;
use outbox_tests::metrics::labelled_gauge;
use outbox_tests::{Running, TestDb};
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_report_their_counters_and_gauges() {
    let log = Log::install(tracing::Level::INFO);
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

    // A labelled gauge's value.
    let labelled = |name: &str, label: (&str, &str)| labelled_gauge(&snapshotter, name, label);

    let db = TestDb::new().await;
    fixtures::create_orders(&db.pool).await;
    // A cause for a health warning the relay must log and count: autovacuum off for the
    // inbox's first partition (a partitioned table has no setting of its own).
    sqlx::query("ALTER TABLE inbox_event_history SET (autovacuum_enabled = off)")
        .execute(&db.pool)
        .await
        .unwrap();
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

    // The relay checked the outbox's health when it started: the warning is logged, naming
    // its cause, and counted by kind; the tables' figures are gauges. (The check runs on a task
    // of its own: wait for its report.)
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !log
        .text()
        .contains("outbox health: autovacuum is off for table")
    {
        assert!(tokio::time::Instant::now() < deadline, "{}", log.text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = read();
    let autovacuum_off = labelled("outbox_health_warnings", ("kind", "autovacuum_off"));
    let server_on: bool = sqlx::query_scalar(
        "SELECT current_setting('autovacuum')::bool AND current_setting('track_counts')::bool",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        autovacuum_off,
        Some(if server_on { 1.0 } else { 2.0 }),
        "the table's, and the server's when it is off"
    );
    assert_eq!(
        labelled("outbox_health_warnings", ("kind", "parked")),
        Some(0.0),
        "every kind is reported, 0 when none stands"
    );
    assert!(labelled("outbox_table_dead_rows", ("table", "outbox_event")).is_some());
    assert_eq!(
        m[&(MetricKind::Gauge, "outbox_autovacuum_enabled".into())],
        if server_on { 1.0 } else { 0.0 }
    );
    let text = log.text();
    let line = text
        .lines()
        .find(|l| l.contains("outbox health: autovacuum is off for table inbox_event_history "))
        .unwrap_or_else(|| panic!("the warning in the log:\n{text}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("kind=autovacuum_off"), "{line}");
    assert_eq!(
        text.matches("is off for table inbox_event_history ")
            .count(),
        1,
        "logged once while it stands:\n{text}"
    );
}
