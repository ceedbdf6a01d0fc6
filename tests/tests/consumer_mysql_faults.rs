//! A dedup consumer on a MariaDB server of the test's own, killed with SIGKILL mid-stream and
//! started again: every event's effect once (none lost with a batch cut short, none repeated
//! for a commit whose answer never came), each key's order kept, and the consumer going on by
//! itself once the server is back. From Kafka, and from JetStream with two instances under the
//! group's lease (held in that server), the nats-server killed too.

use std::time::Duration;

use outbox_runtime::inbox::Consumer;
use outbox_runtime::relay::JetStream;
use outbox_tests::deposits::{interleaved, PARTITIONS, TOPIC};
use outbox_tests::kafka::{committed_total, produce, Kafka};
use outbox_tests::mysql::{count_when_up, create_steps, record_step, steps, MariaDbServer};
use outbox_tests::nats::NatsServer;
use outbox_tests::payments::wait_for;
use outbox_tests::Running;
use rdkafka::ClientConfig;
use sqlx::MySqlPool;

/// Every account's steps once each, in order, and every pair recorded once.
async fn assert_each_step_once_in_order(pool: &MySqlPool, accounts: usize, seqs: u64) {
    let steps = steps(pool).await;
    assert_eq!(steps.len(), accounts);
    let expected: Vec<i64> = (0..seqs as i64).collect();
    for (account, seqs) in steps {
        assert_eq!(
            seqs, expected,
            "account {account}: each step once, in order"
        );
    }
    let recorded = count_when_up(pool, "SELECT COUNT(*) FROM processed_event").await;
    assert_eq!(
        recorded,
        accounts as i64 * seqs as i64,
        "every pair recorded once"
    );
}

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
    assert_each_step_once_in_order(&pool, ACCOUNTS, SEQS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_consumers_lose_and_repeat_nothing_when_either_server_is_killed() {
    const ACCOUNTS: usize = 20;
    const SEQS: u64 = 40;
    let total = ACCOUNTS as i64 * SEQS as i64;
    let mut server = MariaDbServer::start().await;
    let pool = server.database("outbox_consumer_fault", 8).await;
    create_steps(&pool).await;
    let mut nats = NatsServer::start().await;
    nats.create_stream("ACCOUNTS", TOPIC, |_| {}).await;
    nats.publish(TOPIC, &interleaved(ACCOUNTS, SEQS)).await;

    // Two instances of the group: one reads under the lease, the other stands by.
    let mut running = Vec::new();
    for _ in 0..2 {
        let consumer = Consumer::builder(pool.clone())
            .jetstream(JetStream::new(nats.client().await).ack_wait(Duration::from_secs(2)))
            .group_id("ledger")
            .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
            .batch_size(20)
            .handler(record_step)
            .build()
            .unwrap();
        running.push(Running::consumer(&consumer));
    }
    // Once they handle, the database dies mid-stream (the lease's rows with it, a batch's
    // fence lock gone with its connection) and comes back a second later; then nats-server
    // dies (acknowledgements on their way lost) and comes back.
    while count_when_up(&pool, "SELECT COUNT(*) FROM steps").await < total / 4 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.restart().await;
    while count_when_up(&pool, "SELECT COUNT(*) FROM steps").await < total / 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    nats.kill();
    nats.spawn().await;

    wait_for("every message settled", Duration::from_secs(90), || async {
        nats.unsettled("ACCOUNTS", &format!("ledger_{}", TOPIC.replace('.', "_")))
            .await
            == Some((0, 0))
    })
    .await;
    Running::stop_all(running).await;
    assert_each_step_once_in_order(&pool, ACCOUNTS, SEQS).await;
}
