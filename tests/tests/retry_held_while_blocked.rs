//! A message waiting in the retry topic (its partition paused and rewound until the message is
//! due) while a send to a missing dead-letter topic blocks the consumer, then unblocks it
//! (which resumes every partition it paused): the waiting message is not skipped, and is
//! handled once due. Its own test binary: the metrics recorder is process-wide.

use std::time::Duration;

use outbox_tests::fixtures::{self, PAYMENTS};
use outbox_tests::kafka::{consume, produce, Kafka, Outgoing};
use outbox_tests::payments::{
    builder, forward_blocked_gauge, orders_with_payments, orders_with_special_payments,
    paid_counts, publish, wait_for, PARTITIONS,
};
use outbox_tests::{Running, TestDb};
use rdkafka::ClientConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_waiting_in_the_retry_topic_survives_a_blocked_send() {
    let blocked = forward_blocked_gauge(None);

    let db = TestDb::new().await;
    fixtures::create_orders(&db.pool).await;
    let kafka = Kafka::mock();
    kafka.create_topic(PAYMENTS, PARTITIONS).await;
    let retry = format!("{PAYMENTS}.retry");
    kafka.create_topic(&retry, PARTITIONS).await;
    let mut producer_config = ClientConfig::new();
    producer_config
        .set("allow.auto.create.topics", "false")
        .set("topic.metadata.propagation.max.ms", "1000");
    let consumer = builder(&db, &kafka, "orders")
        .producer_config(producer_config)
        .handler(fixtures::sometimes_failing_mark_paid)
        // A wait of 5 s after a first failure, 10 s after a second; a blocked send tries
        // again after 5 s.
        .retry_backoff(Duration::from_secs(5), Duration::from_secs(10))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);

    // A payment that fails twice: after its second failure it waits 10 s in the retry topic.
    let waiting = orders_with_special_payments(&db.pool, 1, |_| true, 7).await;
    let order = waiting[0].1.order_id;
    publish(&kafka, &waiting).await;
    consume(
        &kafka.bootstrap(),
        &retry,
        PARTITIONS,
        Duration::from_secs(30),
        |r| {
            r.iter()
                .any(|m| m.headers.get("outbox_retry_attempts").map(String::as_str) == Some("2"))
        },
    )
    .await;

    // Meanwhile a message for a dead-letter topic that does not exist yet, and more payments.
    let poison = Outgoing {
        key: "k".into(),
        payload: b"not json".to_vec(),
        headers: Vec::new(),
    };
    produce(&kafka.bootstrap(), PAYMENTS, &[poison]).await;
    let others = orders_with_payments(&db.pool, 20).await;
    publish(&kafka, &others).await;
    wait_for("the consumer blocked", Duration::from_secs(30), || async {
        blocked() == Some(1.0)
    })
    .await;
    kafka.create_topic(&format!("{PAYMENTS}.dlq"), 1).await;
    wait_for(
        "the consumer unblocked",
        Duration::from_secs(30),
        || async { blocked() == Some(0.0) },
    )
    .await;
    assert_eq!(
        fixtures::flaky_calls(order),
        2,
        "unblocked before the waiting payment was due"
    );

    wait_for("every payment applied", Duration::from_secs(60), || async {
        paid_counts(&db.pool).await.iter().sum::<i32>() == 21
    })
    .await;
    running.stop().await;
    assert_eq!(paid_counts(&db.pool).await, vec![1; 21]);
    assert_eq!(
        fixtures::flaky_calls(order),
        3,
        "handled on its third attempt"
    );
}
