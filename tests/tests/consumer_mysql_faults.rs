//! A dedup consumer on a MariaDB server of the test's own, killed with SIGKILL mid-stream and
//! started again: every event's effect once (none lost with a batch cut short, none repeated
//! for a commit whose answer never came), each key's order kept, and the consumer going on by
//! itself once the server is back.

use std::time::Duration;

use outbox_runtime::inbox::Consumer;
use outbox_tests::deposits::{interleaved, PARTITIONS, TOPIC};
use outbox_tests::kafka::{committed_total, produce, Kafka};
use outbox_tests::mysql::{count_when_up, create_steps, record_step, steps, MariaDbServer};
use outbox_tests::Running;
use rdkafka::ClientConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_killed_under_a_consumer_loses_and_repeats_nothing() {
    const ACCOUNTS: usize = 20;
    const SEQS: u64 = 40;
    let total = ACCOUNTS as i64 * SEQS as i64;
    let mut server = MariaDbServer::start().await;
    let pool = server.database("outbox_consumer_fault", 8).await;
    create_steps(&pool).await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    kafka
        .create_topic(&format!("{TOPIC}.retry"), PARTITIONS)
        .await;
    kafka.create_topic(&format!("{TOPIC}.dlq"), 1).await;
    produce(&kafka.bootstrap(), TOPIC, &interleaved(ACCOUNTS, SEQS)).await;

    let mut config = ClientConfig::new();
    config.set("auto.commit.interval.ms", "100");
    let consumer = Consumer::builder(pool.clone())
        .brokers(kafka.bootstrap())
        .group_id("ledger")
        .consumer_config(config)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
        .batch_size(20)
        .handler(record_step)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    // Once it is handling, the server dies mid-stream and comes back a second later.
    while count_when_up(&pool, "SELECT COUNT(*) FROM steps").await < total / 4 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.restart().await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while count_when_up(&pool, "SELECT COUNT(*) FROM processed_event").await < total {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the consumer never finished after the restart"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while committed_total(&kafka.bootstrap(), "ledger", TOPIC, PARTITIONS) != total {
        assert!(
            tokio::time::Instant::now() < deadline,
            "offsets never committed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.stop().await;

    let steps = steps(&pool).await;
    assert_eq!(steps.len(), ACCOUNTS);
    let expected: Vec<i64> = (0..SEQS as i64).collect();
    for (account, seqs) in steps {
        assert_eq!(
            seqs, expected,
            "account {account}: each step once, in order"
        );
    }
    let recorded = count_when_up(&pool, "SELECT COUNT(*) FROM processed_event").await;
    assert_eq!(recorded, total, "every pair recorded once");
}
