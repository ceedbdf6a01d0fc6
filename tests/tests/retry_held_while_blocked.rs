//! A message waiting in the retry topic (its partition paused and rewound until the message is
//! due) while a send to a missing dead-letter topic blocks the consumer, then unblocks it
//! (which resumes every partition it paused): the waiting message is not skipped, and is
//! handled once due. Its own test binary: the metrics recorder is process-wide.

use std::time::Duration;

use outbox_tests::fixtures::{self, PAYMENTS};
use outbox_tests::kafka::{consume, produce, Kafka};
use outbox_tests::payments::{
    builder, forward_blocked_gauge, no_auto_created_topics, not_json, orders_with_payments,
    orders_with_special_payments, paid_counts, publish, setup_without_dead_letter_topic, wait_for,
    PARTITIONS,
};
use outbox_tests::Running;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_waiting_in_the_retry_topic_survives_a_blocked_send() {
    let blocked = forward_blocked_gauge(None);

    let (db, kafka) = setup_without_dead_letter_topic(Kafka::mock()).await;
    let retry = format!("{PAYMENTS}.retry");
    let consumer = builder(&db, &kafka, "orders")
        .producer_config(no_auto_created_topics())
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
    produce(&kafka.bootstrap(), PAYMENTS, &[not_json()]).await;
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
