//! Consumer throughput for a trivial handler, beside the raw consumer, on one broker and one
//! database in one run: dedup mode, inbox receipt, inbox processing (1 and 2 processors).
//!
//! `cargo bench -p outbox-tests --bench consumer` (env: `N`, default 20000; `ROUNDS`, default 3).

use std::time::{Duration, Instant};

use outbox_runtime::inbox::{Consumer, HandlerError, Mode};
use outbox_runtime::{inbox_handler, OutboxEvent};
use outbox_tests::bench::{env, median, rate};
use outbox_tests::kafka::{produce, Kafka, Outgoing};
use outbox_tests::TestDb;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::ClientConfig;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const TOPIC: &str = "bench.payments";
const PARTITIONS: i32 = 12;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(
    topic = "bench.payments",
    aggregate_type = "Payment",
    event_type = "PaymentSucceeded"
)]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    payment_id: Uuid,
    order_id: Uuid,
    amount: i64,
}

/// Does nothing: the figures are the framework's cost.
#[inbox_handler]
async fn trivial(event: PaymentSucceeded, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
    let _ = (event, tx);
    Ok(())
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn wait_count(pool: &PgPool, sql: &str, n: i64) {
    while count(pool, sql).await < n {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn raw_consumer(bootstrap: &str, group: &str, n: usize) -> Duration {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[TOPIC]).unwrap();
    let start = Instant::now();
    for _ in 0..n {
        consumer.recv().await.unwrap();
    }
    start.elapsed()
}

fn consumer(db: &TestDb, bootstrap: &str, group: &str, mode: Mode, processors: usize) -> Consumer {
    Consumer::builder(db.pool.clone())
        .brokers(bootstrap)
        .group_id(group)
        .handler(trivial)
        .mode(mode)
        .processors(processors)
        .build()
        .unwrap()
}

#[tokio::main]
async fn main() {
    let n: usize = env("N", 20_000);
    let rounds: usize = env("ROUNDS", 3);
    let kafka = Kafka::mock();
    let bootstrap = kafka.bootstrap();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let records: Vec<Outgoing> = (0..n)
        .map(|_| {
            let e = PaymentSucceeded {
                payment_id: Uuid::now_v7(),
                order_id: Uuid::now_v7(),
                amount: 100,
            };
            Outgoing::event(&e, Uuid::now_v7())
        })
        .collect();
    produce(&bootstrap, TOPIC, &records).await;
    let db = TestDb::new().await;
    println!("consumer benchmark: {n} messages, {PARTITIONS} partitions, trivial handler, {rounds} rounds");
    let mut results: [Vec<f64>; 5] = Default::default();
    for round in 0..rounds {
        let raw = rate(
            n as u64,
            raw_consumer(&bootstrap, &format!("raw-{round}"), n).await,
        );

        sqlx::query("TRUNCATE processed_event, inbox_event")
            .execute(&db.pool)
            .await
            .unwrap();
        let cancel = CancellationToken::new();
        let start = Instant::now();
        let handle = consumer(&db, &bootstrap, &format!("dedup-{round}"), Mode::Dedup, 0)
            .spawn(cancel.clone());
        wait_count(&db.pool, "SELECT count(*) FROM processed_event", n as i64).await;
        let dedup = rate(n as u64, start.elapsed());
        cancel.cancel();
        handle.await.unwrap().unwrap();

        // Receipt alone: no processors.
        let cancel = CancellationToken::new();
        let start = Instant::now();
        let inbox = consumer(&db, &bootstrap, &format!("inbox-{round}"), Mode::Inbox, 0);
        let handle = inbox.spawn(cancel.clone());
        wait_count(&db.pool, "SELECT count(*) FROM inbox_event", n as i64).await;
        let receipt = rate(n as u64, start.elapsed());
        cancel.cancel();
        handle.await.unwrap().unwrap();

        let start = Instant::now();
        inbox.process_inbox_pending().await.unwrap();
        let one = rate(n as u64, start.elapsed());

        sqlx::query("UPDATE inbox_event SET processed = false, processed_at = NULL")
            .execute(&db.pool)
            .await
            .unwrap();
        sqlx::query("VACUUM inbox_event")
            .execute(&db.pool)
            .await
            .unwrap();
        let start = Instant::now();
        let (a, b) = tokio::join!(inbox.process_inbox_pending(), inbox.process_inbox_pending());
        assert_eq!(a.unwrap() + b.unwrap(), n as u64);
        let two = rate(n as u64, start.elapsed());
        println!(
            "round {round}: raw {raw:.0}/s, dedup {dedup:.0}/s, inbox receipt {receipt:.0}/s, \
             processing 1: {one:.0}/s, 2: {two:.0}/s"
        );
        for (i, r) in [raw, dedup, receipt, one, two].into_iter().enumerate() {
            results[i].push(r);
        }
    }
    let [raw, dedup, receipt, one, two] = results.map(median);
    println!();
    println!("medians over {rounds} rounds (messages/s):");
    println!("  raw consumer (no processing)     {raw:>9.0}");
    println!(
        "  dedup mode                       {dedup:>9.0}   {:.1}% of raw",
        dedup / raw * 100.0
    );
    println!(
        "  inbox mode, receipt              {receipt:>9.0}   {:.1}% of raw",
        receipt / raw * 100.0
    );
    println!("  inbox mode, processing, 1 task   {one:>9.0}");
    println!("  inbox mode, processing, 2 tasks  {two:>9.0}");
}
