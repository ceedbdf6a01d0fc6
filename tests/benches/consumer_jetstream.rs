//! Consumers from NATS JetStream beside consumers from Kafka (librdkafka's mock cluster), in one
//! run on one database, so that the ratios mean something on a noisy machine. Each figure counts
//! from the first message handled (joining a group, taking a lease are not the steady state):
//!
//! 1. async-nats alone pulling and acknowledging the N messages of a durable consumer:
//!    JetStream's ceiling on this machine (the raw Kafka consumer's figure is in the `consumer`
//!    benchmark);
//! 2. dedup mode, a trivial handler, from Kafka (the baseline) and from JetStream: the table
//!    counted every 2 ms while the consumer runs, and again with the handler counting its
//!    calls in the process (no query beside the consumer, as beside async-nats alone);
//! 3. inbox receipt from each;
//! 4. the bad case: dedup mode with 1% of the messages failing once (10 ms backoff), retried
//!    through the retry topic on Kafka and redelivered by the server (`nak` with a delay) on
//!    JetStream: the rate until 99% are handled.
//!
//! `cargo bench -p outbox-tests --bench consumer_jetstream` (env: `N`, default 20000;
//! `ROUNDS`, default 3; `ONLY`, figures to run of `raw`, `k-dedup`, `j-dedup`, `k-counted`,
//! `j-counted`, `k-inbox`, `j-inbox`, `k-retry`, `j-retry`, comma-separated). It starts its own nats-server (a file store in a temporary directory).

use std::time::Duration;

use outbox_runtime::inbox::{Consumer, ConsumerBuilder, HandlerError, Mode};
use outbox_runtime::inbox_handler;
use outbox_runtime::relay::JetStream;
use outbox_tests::bench::{
    counted, env, median, rate_counted, rate_until, trivial, PaymentSucceeded, COUNTED,
};
use outbox_tests::kafka::{produce, Kafka, Outgoing};
use outbox_tests::nats::{raw_jetstream, NatsServer};
use outbox_tests::{Running, TestDb};
use uuid::Uuid;

const TOPIC: &str = "bench.payments";
const STREAM: &str = "BENCH_PAYMENTS";
const PARTITIONS: i32 = 12;

/// Does nothing, but fails its first attempt at 1% of the payments (amount 1).
#[inbox_handler]
async fn failing_once_in_a_hundred(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
    meta: &outbox_runtime::inbox::MessageMeta<'_>,
) -> Result<(), HandlerError> {
    let _ = tx;
    if event.amount == 1 && meta.attempt() == 1 {
        return Err(HandlerError::retryable("fails once"));
    }
    Ok(())
}

/// Where a consumer reads from.
enum From<'a> {
    Kafka(&'a str),
    JetStream(&'a NatsServer),
}

async fn builder(db: &TestDb, from: &From<'_>, group: &str) -> ConsumerBuilder {
    let builder = Consumer::builder(db.pool.clone()).group_id(group);
    match from {
        From::Kafka(bootstrap) => builder.brokers(*bootstrap),
        From::JetStream(server) => builder.jetstream(JetStream::new(server.client().await)),
    }
}

/// How a figure knows the consumer's progress.
#[derive(Clone, Copy, PartialEq)]
enum Progress {
    /// A `count(*)` of the table every 2 ms (a backend busy beside the consumer).
    Polled,
    /// Dedup mode only: the handler counts its calls in the process, and the table is counted
    /// once they are all made (nothing beside the consumer while it runs, as for async-nats
    /// alone).
    Counted,
}

/// Dedup or inbox receipt with a handler that does nothing: messages per second.
async fn consume(
    db: &TestDb,
    from: &From<'_>,
    group: &str,
    mode: Mode,
    progress: Progress,
    n: usize,
) -> f64 {
    sqlx::query("TRUNCATE processed_event, inbox_event")
        .execute(&db.pool)
        .await
        .unwrap();
    COUNTED.store(0, std::sync::atomic::Ordering::Relaxed);
    let builder = builder(db, from, group).await;
    let builder = match progress {
        Progress::Polled => builder.handler(trivial),
        Progress::Counted => builder.handler(counted),
    };
    let consumer = builder.mode(mode).processors(0).build().unwrap();
    let running = Running::consumer(&consumer);
    let table = match mode {
        Mode::Dedup => "processed_event",
        Mode::Inbox => "inbox_event",
    };
    let sql = format!("SELECT count(*) FROM {table}");
    let rate = match progress {
        Progress::Polled => rate_until(&db.pool, &sql, n as i64).await,
        Progress::Counted => rate_counted(&db.pool, &sql, n as i64).await,
    };
    running.stop().await;
    rate
}

/// Dedup mode, 1% failing once: the rate until 99% are handled.
async fn one_percent_retried(db: &TestDb, from: &From<'_>, group: &str, n: usize) -> f64 {
    sqlx::query("TRUNCATE processed_event")
        .execute(&db.pool)
        .await
        .unwrap();
    let consumer = builder(db, from, group)
        .await
        .handler(failing_once_in_a_hundred)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(10))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    let sql = "SELECT count(*) FROM processed_event";
    let flow = rate_until(&db.pool, sql, (n - n / 100) as i64).await;
    running.stop().await;
    flow
}

/// The figures of a round, in the order printed.
const FIGURES: [&str; 9] = [
    "raw",
    "k-dedup",
    "j-dedup",
    "k-counted",
    "j-counted",
    "k-inbox",
    "j-inbox",
    "k-retry",
    "j-retry",
];

#[tokio::main]
async fn main() {
    let n: usize = env("N", 20_000);
    let rounds: usize = env("ROUNDS", 3);
    let records: Vec<Outgoing> = (0..n)
        .map(|i| {
            let e = PaymentSucceeded {
                payment_id: Uuid::now_v7(),
                order_id: Uuid::now_v7(),
                amount: if i % 100 == 7 { 1 } else { 100 },
            };
            Outgoing::event(&e, Uuid::now_v7())
        })
        .collect();
    let kafka = Kafka::mock();
    let bootstrap = kafka.bootstrap();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    kafka
        .create_topic(&format!("{TOPIC}.retry"), PARTITIONS)
        .await;
    kafka.create_topic(&format!("{TOPIC}.dlq"), 1).await;
    produce(&bootstrap, TOPIC, &records).await;
    let server = NatsServer::start().await;
    server.create_stream(STREAM, TOPIC, |_| {}).await;
    server
        .create_stream("BENCH_PAYMENTS_DLQ", &format!("{TOPIC}.dlq"), |_| {})
        .await;
    server.publish(TOPIC, &records).await;
    let db = TestDb::new().await;
    let (on_kafka, on_jetstream) = (From::Kafka(&bootstrap), From::JetStream(&server));
    println!(
        "consumer benchmark, Kafka (mock cluster, {PARTITIONS} partitions) vs JetStream \
         (nats-server, file store): {n} messages, trivial handler, {rounds} rounds, autovacuum {}",
        outbox_tests::bench::autovacuum(&db.pool).await
    );
    // `ONLY=raw,j-counted` runs those figures alone (the others print as NaN).
    let only: Option<Vec<String>> = std::env::var("ONLY")
        .ok()
        .map(|v| v.split(',').map(str::to_owned).collect());
    let mut results: [Vec<f64>; FIGURES.len()] = Default::default();
    // Per round, JetStream's dedup consumer (counted in the handler) / async-nats alone.
    let mut to_raw = Vec::new();
    for round in 0..rounds {
        let mut figures = [f64::NAN; FIGURES.len()];
        for (figure, name) in figures.iter_mut().zip(FIGURES) {
            if only.as_ref().is_some_and(|o| !o.iter().any(|n| n == name)) {
                continue;
            }
            let group = format!("{name}-{round}");
            let (k, j) = (&on_kafka, &on_jetstream);
            let (dedup, inbox) = (Mode::Dedup, Mode::Inbox);
            let (polled, in_handler) = (Progress::Polled, Progress::Counted);
            *figure = match name {
                "raw" => raw_jetstream(&server, STREAM, &group, n).await,
                "k-dedup" => consume(&db, k, &group, dedup, polled, n).await,
                "j-dedup" => consume(&db, j, &group, dedup, polled, n).await,
                "k-counted" => consume(&db, k, &group, dedup, in_handler, n).await,
                "j-counted" => consume(&db, j, &group, dedup, in_handler, n).await,
                "k-inbox" => consume(&db, k, &group, inbox, polled, n).await,
                "j-inbox" => consume(&db, j, &group, inbox, polled, n).await,
                "k-retry" => one_percent_retried(&db, k, &group, n).await,
                _ => one_percent_retried(&db, j, &group, n).await,
            };
        }
        println!(
            "round {round}: raw {:.0}/s; dedup kafka {:.0}/s, jetstream {:.0}/s; counted in \
             the handler: kafka {:.0}/s, jetstream {:.0}/s; inbox receipt kafka {:.0}/s, \
             jetstream {:.0}/s; 1% retried kafka {:.0}/s, jetstream {:.0}/s",
            figures[0],
            figures[1],
            figures[2],
            figures[3],
            figures[4],
            figures[5],
            figures[6],
            figures[7],
            figures[8]
        );
        to_raw.push(figures[4] / figures[0]);
        for (all, figure) in results.iter_mut().zip(figures) {
            all.push(figure);
        }
    }
    let [raw, k_dedup, j_dedup, k_count, j_count, k_inbox, j_inbox, k_retry, j_retry] =
        results.map(median);
    println!("medians of {rounds} rounds (msg/s):");
    println!("  async-nats alone, pull + ack      {raw:>9.0}");
    println!(
        "  dedup        kafka {k_dedup:>9.0}   jetstream {j_dedup:>9.0}   ratio {:.2}",
        j_dedup / k_dedup
    );
    println!(
        "  dedup, counted in the handler: kafka {k_count:>9.0}   jetstream {j_count:>9.0}   \
         ratio {:.2}",
        j_count / k_count
    );
    println!(
        "  inbox receipt kafka {k_inbox:>8.0}   jetstream {j_inbox:>9.0}   ratio {:.2}",
        j_inbox / k_inbox
    );
    println!(
        "  1% retried   kafka {k_retry:>9.0}   jetstream {j_retry:>9.0}   ratio {:.2}",
        j_retry / k_retry
    );
    println!(
        "  jetstream dedup / async-nats alone: {:.2} (table polled), {:.2} (counted in the \
         handler); per round, counted: {:.2} (median), rounds {:.2?}",
        j_dedup / raw,
        j_count / raw,
        median(to_raw.clone()),
        to_raw
    );
}
