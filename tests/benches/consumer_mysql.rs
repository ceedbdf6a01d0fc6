//! The dedup consumer on MariaDB beside PostgreSQL's, in one run on one broker: the raw
//! consumer (the broker's ceiling), then each database with a handler that does nothing and
//! with one that inserts a row (an effect), each figure from the first message handled.
//!
//! `cargo bench -p outbox-tests --bench consumer_mysql` (env: `N`, default 20000; `ROUNDS`,
//! default 3; `BROKER`, `kafka` (librdkafka's mock cluster, the default) or `jetstream` (a
//! nats-server of its own: each group reads under its lease, in the database it runs on)).

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use outbox_runtime::inbox::{Consumer, ConsumerDatabase, Handler, HandlerError};
use outbox_runtime::inbox_handler;
use outbox_runtime::relay::JetStream;
use outbox_tests::bench::{env, first_seen_until, median, rate, PaymentSucceeded};
use outbox_tests::kafka::{produce, Kafka, Outgoing};
use outbox_tests::mysql::MySqlTestDb;
use outbox_tests::nats::{raw_jetstream, NatsServer};
use outbox_tests::{Running, TestDb};
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::ClientConfig;
use sqlx::{MySqlConnection, PgConnection};
use uuid::Uuid;

const TOPIC: &str = "bench.payments";
/// The JetStream stream of the topic.
const STREAM: &str = "BENCH_PAYMENTS";
const PARTITIONS: i32 = 12;

/// Handler calls so far, read in process (no query competes with the consumer while it runs).
static CALLS: AtomicI64 = AtomicI64::new(0);

#[inbox_handler]
async fn nothing_pg(event: PaymentSucceeded, tx: &mut PgConnection) -> Result<(), HandlerError> {
    let _ = (event, tx);
    CALLS.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

#[inbox_handler]
async fn nothing_mysql(
    event: PaymentSucceeded,
    tx: &mut MySqlConnection,
) -> Result<(), HandlerError> {
    let _ = (event, tx);
    CALLS.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

#[inbox_handler]
async fn insert_pg(event: PaymentSucceeded, tx: &mut PgConnection) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (order_id, amount) VALUES ($1, $2)")
        .bind(event.order_id)
        .bind(event.amount)
        .execute(tx)
        .await?;
    CALLS.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

#[inbox_handler]
async fn insert_mysql(
    event: PaymentSucceeded,
    tx: &mut MySqlConnection,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (order_id, amount) VALUES (?, ?)")
        .bind(event.order_id)
        .bind(event.amount)
        .execute(tx)
        .await?;
    CALLS.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

async fn raw_consumer(bootstrap: &str, group: &str, n: usize) -> f64 {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[TOPIC]).unwrap();
    consumer.recv().await.unwrap();
    let start = Instant::now();
    for _ in 1..n {
        consumer.recv().await.unwrap();
    }
    rate(n as u64 - 1, start.elapsed())
}

/// The broker the figures are read from.
enum Broker {
    Kafka(Kafka),
    JetStream(NatsServer, JetStream),
}

impl Broker {
    /// The broker's ceiling: its own client alone, group `group`.
    async fn raw(&self, group: &str, n: usize) -> f64 {
        match self {
            Broker::Kafka(kafka) => raw_consumer(&kafka.bootstrap(), group, n).await,
            Broker::JetStream(server, _) => raw_jetstream(server, STREAM, group, n).await,
        }
    }
}

/// The rate of a consumer of group `group` on `pool` with `handler`, from its first call until
/// its `n`-th.
async fn dedup<D: ConsumerDatabase, H: Handler<(), D>>(
    pool: sqlx::Pool<D>,
    broker: &Broker,
    group: &str,
    handler: H,
    n: usize,
) -> f64 {
    CALLS.store(0, Ordering::Relaxed);
    let builder = Consumer::builder(pool);
    let builder = match broker {
        Broker::Kafka(kafka) => builder.brokers(kafka.bootstrap()),
        Broker::JetStream(_, jetstream) => builder.jetstream(jetstream.clone()),
    };
    let consumer = builder.group_id(group).handler(handler).build().unwrap();
    let running = Running::consumer(&consumer);
    let calls = || async { CALLS.load(Ordering::Relaxed) };
    let (at, from) = first_seen_until(calls, n as i64, 1).await;
    let rate = rate((n as i64 - from).max(1) as u64, at.elapsed());
    running.stop().await;
    rate
}

#[tokio::main]
async fn main() {
    let n: usize = env("N", 20_000);
    let rounds: usize = env("ROUNDS", 3);
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
    let broker = if std::env::var("BROKER").as_deref() == Ok("jetstream") {
        let server = NatsServer::start().await;
        server.create_stream(STREAM, TOPIC, |_| {}).await;
        server
            .create_stream(&format!("{STREAM}_DLQ"), &format!("{TOPIC}.dlq"), |_| {})
            .await;
        server.publish(TOPIC, &records).await;
        let jetstream = JetStream::new(server.client().await);
        Broker::JetStream(server, jetstream)
    } else {
        let kafka = Kafka::mock();
        kafka.create_topic(TOPIC, PARTITIONS).await;
        kafka
            .create_topic(&format!("{TOPIC}.retry"), PARTITIONS)
            .await;
        kafka.create_topic(&format!("{TOPIC}.dlq"), 1).await;
        produce(&kafka.bootstrap(), TOPIC, &records).await;
        Broker::Kafka(kafka)
    };
    let name = match broker {
        Broker::Kafka(_) => "the mock cluster",
        Broker::JetStream(..) => "JetStream",
    };
    let pg = TestDb::new().await;
    sqlx::query("CREATE TABLE effects (order_id uuid NOT NULL, amount bigint NOT NULL)")
        .execute(&pg.pool)
        .await
        .unwrap();
    let my = MySqlTestDb::new().await;
    sqlx::query("CREATE TABLE effects (order_id BINARY(16) NOT NULL, amount BIGINT NOT NULL)")
        .execute(&my.pool)
        .await
        .unwrap();
    println!("dedup consumer, PostgreSQL and MariaDB, from {name}: {n} messages, {rounds} rounds");
    let mut results: [Vec<f64>; 5] = Default::default();
    for round in 0..rounds {
        let raw = broker.raw(&format!("raw-{round}"), n).await;
        let mut figures = vec![raw];
        for (handler, with_insert) in [("nothing", false), ("insert", true)] {
            sqlx::query("TRUNCATE processed_event")
                .execute(&pg.pool)
                .await
                .unwrap();
            sqlx::query("TRUNCATE effects")
                .execute(&pg.pool)
                .await
                .unwrap();
            sqlx::query("TRUNCATE processed_event")
                .execute(&my.pool)
                .await
                .unwrap();
            sqlx::query("TRUNCATE effects")
                .execute(&my.pool)
                .await
                .unwrap();
            let group = |db: &str| format!("{db}-{handler}-{round}");
            let (p, m) = if with_insert {
                (
                    dedup(pg.pool.clone(), &broker, &group("pg"), insert_pg, n).await,
                    dedup(my.pool.clone(), &broker, &group("my"), insert_mysql, n).await,
                )
            } else {
                (
                    dedup(pg.pool.clone(), &broker, &group("pg"), nothing_pg, n).await,
                    dedup(my.pool.clone(), &broker, &group("my"), nothing_mysql, n).await,
                )
            };
            figures.extend([p, m]);
        }
        println!(
            "round {round}: raw {:.0}/s; handler doing nothing: PostgreSQL {:.0}/s, MariaDB {:.0}/s; \
             inserting a row: PostgreSQL {:.0}/s, MariaDB {:.0}/s",
            figures[0], figures[1], figures[2], figures[3], figures[4]
        );
        for (i, f) in figures.into_iter().enumerate() {
            results[i].push(f);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let [raw, pg_nothing, my_nothing, pg_insert, my_insert] = results.map(median);
    println!("medians of {rounds} rounds, msg/s (share of the raw consumer):");
    println!("  raw consumer               {raw:>8.0}");
    for (what, pg, my) in [
        ("handler doing nothing", pg_nothing, my_nothing),
        ("handler inserting a row", pg_insert, my_insert),
    ] {
        println!(
            "  {what:<24} PostgreSQL {pg:>8.0} ({:.2}), MariaDB {my:>8.0} ({:.2}); MariaDB / PostgreSQL {:.2}",
            pg / raw,
            my / raw,
            my / pg
        );
    }
}
