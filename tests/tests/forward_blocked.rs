//! A dead-letter topic that does not exist: the consumer says so (an error, a gauge), stays in
//! its group while it waits, and goes on once the topic appears, with every partition, those
//! revoked while it waited included. Its own test binary: the metrics recorder is
//! process-wide.

use std::time::Duration;

use outbox_tests::fixtures::{self, PAYMENTS};
use outbox_tests::kafka::{produce, Kafka};
use outbox_tests::payments::{
    builder, dead_letters, forward_blocked_gauge, no_auto_created_topics, not_json,
    orders_with_payments, paid_counts, publish, setup_without_dead_letter_topic, wait_for,
    PARTITIONS,
};
use outbox_tests::Running;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::ClientConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_topic_blocks_visibly_keeps_the_membership_and_recovers() {
    let blocked = forward_blocked_gauge(Some(format!("{PAYMENTS}.dlq")));
    let dlq = format!("{PAYMENTS}.dlq");

    let (db, kafka) = setup_without_dead_letter_topic(Kafka::mock()).await;
    // A message that is not JSON, then good ones.
    produce(&kafka.bootstrap(), PAYMENTS, &[not_json()]).await;
    let payments = orders_with_payments(&db.pool, 20).await;
    publish(&kafka, &payments).await;

    // A member that stops polling for 7 s leaves its group.
    let mut consumer_config = ClientConfig::new();
    consumer_config
        .set("auto.commit.interval.ms", "100")
        .set("session.timeout.ms", "6000")
        .set("max.poll.interval.ms", "7000");
    let consumer = builder(&db, &kafka, "orders")
        .consumer_config(consumer_config)
        .producer_config(no_auto_created_topics())
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for("the blocked gauge", Duration::from_secs(30), || async {
        blocked() == Some(1.0)
    })
    .await;

    // Longer than max.poll.interval.ms: a member that stopped polling would be gone by now.
    tokio::time::sleep(Duration::from_secs(9)).await;
    // A second member of the group: it gets a share of the partitions (there would be none
    // left for it had the blocked consumer been evicted), and holds them until after the
    // consumer is unblocked. An observer: it commits nothing, so it takes no payment.
    let other: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap())
        .set("group.id", "orders")
        .set("session.timeout.ms", "6000")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .create()
        .unwrap();
    other.subscribe(&[PAYMENTS]).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let assigned = loop {
        let _ = other.poll(Duration::from_millis(100));
        let n = other.assignment().unwrap().count();
        if n > 0 {
            break n;
        }
        assert!(tokio::time::Instant::now() < deadline, "no assignment");
        tokio::task::yield_now().await;
    };
    assert!(
        assigned < PARTITIONS as usize,
        "the blocked consumer kept its share of the partitions ({assigned} of {PARTITIONS} went to the newcomer)"
    );
    // More payments, in every partition (100 keys), while the consumer is blocked.
    let more = orders_with_payments(&db.pool, 100).await;
    publish(&kafka, &more).await;

    kafka.create_topic(&dlq, 1).await;
    wait_for("the gauge cleared", Duration::from_secs(30), || async {
        blocked() == Some(0.0)
    })
    .await;
    // The newcomer leaves: its partitions, paused when the consumer blocked and revoked while
    // it was, come back to the consumer, which must fetch them.
    other.unsubscribe();
    drop(other);
    wait_for("every payment applied", Duration::from_secs(60), || async {
        paid_counts(&db.pool).await.iter().sum::<i32>() == 120
    })
    .await;
    let dead = dead_letters(&kafka, 1, Duration::from_secs(30)).await;
    running.stop().await;
    // Dead letters are sent at least once: a rebalance before its offset is committed sends
    // the message again.
    assert!(dead.iter().all(|d| d.raw == b"not json"), "{dead:?}");
    assert_eq!(paid_counts(&db.pool).await, vec![1; 120]);
}
