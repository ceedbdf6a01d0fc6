//! Runs one relay instance until it is killed: `outbox-test-relay DATABASE_URL BROKERS BATCH`.
//! The relay tests kill it with SIGKILL mid-batch.

use std::time::Duration;

use outbox_runtime::relay::Relay;
use tokio_util::sync::CancellationToken;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(url), Some(brokers), Some(batch)) = (args.next(), args.next(), args.next()) else {
        eprintln!("usage: outbox-test-relay DATABASE_URL BROKERS BATCH_SIZE");
        std::process::exit(2);
    };
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    let relay = Relay::builder(pool)
        .brokers(brokers)
        .batch_size(batch.parse().expect("batch size"))
        .poll_interval(Duration::from_millis(100))
        .build()
        .expect("relay");
    relay.run(CancellationToken::new()).await.expect("relay");
}
