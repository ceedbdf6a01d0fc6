//! Runs a dedup-mode consumer with `mark_order_paid` until it is killed:
//! `outbox-test-consumer DATABASE_URL BROKERS GROUP AUTO_COMMIT_INTERVAL_MS`.

use outbox_runtime::inbox::Consumer;
use outbox_tests::fixtures;
use tokio_util::sync::CancellationToken;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, brokers, group, interval] = args.as_slice() else {
        eprintln!("usage: outbox-test-consumer DATABASE_URL BROKERS GROUP AUTO_COMMIT_INTERVAL_MS");
        std::process::exit(2);
    };
    let pool = sqlx::PgPool::connect(url).await.expect("connect");
    let mut config = rdkafka::ClientConfig::new();
    config.set("auto.commit.interval.ms", interval);
    // A killed member leaves the group after this long; its partitions then move on.
    config.set("session.timeout.ms", "6000");
    let consumer = Consumer::builder(pool)
        .brokers(brokers)
        .group_id(group)
        .consumer_config(config)
        .handler(fixtures::mark_order_paid)
        .build()
        .expect("consumer");
    consumer
        .run(CancellationToken::new())
        .await
        .expect("consumer");
}
