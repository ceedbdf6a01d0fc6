//! Runs a dedup-mode consumer of the payments, paying orders, until it is killed:
//! `outbox-test-consumer DATABASE_URL BROKERS GROUP AUTO_COMMIT_INTERVAL_MS`. A `mysql://` URL
//! runs it on MariaDB/MySQL (`outbox_tests::mysql::mark_order_paid`), any other on PostgreSQL
//! (`fixtures::mark_order_paid`).

use outbox_runtime::inbox::{Consumer, ConsumerBuilder, ConsumerDatabase};
use outbox_tests::{fixtures, mysql};
use tokio_util::sync::CancellationToken;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, brokers, group, interval] = args.as_slice() else {
        eprintln!("usage: outbox-test-consumer DATABASE_URL BROKERS GROUP AUTO_COMMIT_INTERVAL_MS");
        std::process::exit(2);
    };
    let consumer = if url.starts_with("mysql://") {
        let pool = sqlx::MySqlPool::connect(url).await.expect("connect");
        configured(Consumer::builder(pool), brokers, group, interval)
            .handler(mysql::mark_order_paid)
            .build()
    } else {
        let pool = sqlx::PgPool::connect(url).await.expect("connect");
        configured(Consumer::builder(pool), brokers, group, interval)
            .handler(fixtures::mark_order_paid)
            .build()
    };
    consumer
        .expect("consumer")
        .run(CancellationToken::new())
        .await
        .expect("consumer");
}

/// The consumer's settings: `brokers`, `group`, offsets committed every `interval` ms, and a
/// killed member out of the group after 6 s (its partitions then move on).
fn configured<D: ConsumerDatabase>(
    builder: ConsumerBuilder<(), D>,
    brokers: &str,
    group: &str,
    interval: &str,
) -> ConsumerBuilder<(), D> {
    let mut config = rdkafka::ClientConfig::new();
    config.set("auto.commit.interval.ms", interval);
    config.set("session.timeout.ms", "6000");
    builder
        .brokers(brokers)
        .group_id(group)
        .consumer_config(config)
}
