//! Consumers from RabbitMQ beside consumers from Kafka (librdkafka's mock cluster) and NATS
//! JetStream, in one run on one database, so that the ratios mean something on a noisy machine.
//! Each figure counts from the first message handled (declaring, subscribing and a group's
//! join are not the steady state):
//!
//! 1. amqprs alone consuming and acknowledging the N messages of a group's shard queues (the
//!    quorum queues, single active consumer, the consumer declares): RabbitMQ's ceiling here;
//! 2. dedup mode, a trivial handler, from Kafka (the baseline), JetStream and RabbitMQ;
//! 3. inbox receipt from Kafka and RabbitMQ.
//!
//! `cargo bench -p outbox-tests --bench consumer_rabbitmq` (env: `N`, default 20000; `ROUNDS`,
//! default 3). RabbitMQ is the machine's node (127.0.0.1:5672): the run's groups (and so their
//! queues) have names of their own; its queues and the exchange are deleted at the end.

use std::time::{Duration, Instant};

use amqprs::channel::{BasicAckArguments, BasicConsumeArguments, BasicQosArguments};
use outbox_runtime::inbox::{Consumer, ConsumerBuilder, Mode};
use outbox_runtime::rabbitmq::RabbitMq;
use outbox_runtime::relay::JetStream;
use outbox_tests::bench::{env, median, rate, rate_until, trivial, PaymentSucceeded};
use outbox_tests::kafka::{produce, Kafka, Outgoing};
use outbox_tests::nats::NatsServer;
use outbox_tests::rabbitmq::{connect, delete_exchange, delete_queue, publish, unique_name};
use outbox_tests::{Running, TestDb};
use uuid::Uuid;

const TOPIC: &str = "bench.payments";
const STREAM: &str = "BENCH_PAYMENTS";
const PARTITIONS: i32 = 12;
/// RabbitMQ's shards: the default.
const SHARDS: u16 = 4;
const URL: &str = outbox_tests::rabbitmq::SHARED_URL;

/// Where a consumer reads from.
enum From<'a> {
    Kafka(&'a str),
    JetStream(&'a NatsServer),
    RabbitMq,
}

/// Declares `group`'s shard queues of `exchange` and fills them with `records`, spread over the
/// shards as the relay spreads keys.
async fn fill(exchange: &str, group: &str, records: &[Outgoing]) -> Vec<String> {
    RabbitMq::new(URL)
        .shards(SHARDS)
        .ensure_topology(exchange, group)
        .await
        .unwrap();
    let per_shard = records.len().div_ceil(usize::from(SHARDS));
    for (shard, chunk) in records.chunks(per_shard).enumerate() {
        publish(URL, exchange, &shard.to_string(), chunk).await;
    }
    (0..SHARDS)
        .map(|shard| format!("{exchange}.{group}.{shard}"))
        .collect()
}

/// amqprs alone: the group's shard queues consumed and each message acknowledged, one channel
/// per queue.
async fn raw_rabbitmq(exchange: &str, group: &str, records: &[Outgoing]) -> f64 {
    let queues = fill(exchange, group, records).await;
    let (connection, channel) = connect(URL).await;
    channel
        .basic_qos(BasicQosArguments::new(0, 500, false))
        .await
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for queue in &queues {
        let mut args = BasicConsumeArguments::new(queue, "");
        args.manual_ack(true);
        let (_, mut deliveries) = channel.basic_consume_rx(args).await.unwrap();
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Some(message) = deliveries.recv().await {
                if let Some(deliver) = message.deliver {
                    let _ = tx.send(deliver.delivery_tag());
                }
            }
        });
    }
    let n = records.len();
    let first = rx.recv().await.unwrap();
    channel
        .basic_ack(BasicAckArguments::new(first, false))
        .await
        .unwrap();
    let start = Instant::now();
    for _ in 1..n {
        let tag = rx.recv().await.unwrap();
        channel
            .basic_ack(BasicAckArguments::new(tag, false))
            .await
            .unwrap();
    }
    let figure = rate(n as u64 - 1, start.elapsed());
    let _ = tokio::time::timeout(Duration::from_secs(2), channel.close()).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), connection.close()).await;
    figure
}

async fn builder(db: &TestDb, from: &From<'_>, group: &str) -> ConsumerBuilder {
    let builder = Consumer::builder(db.pool.clone()).group_id(group);
    match from {
        From::Kafka(bootstrap) => builder.brokers(*bootstrap),
        From::JetStream(server) => builder.jetstream(JetStream::new(server.client().await)),
        From::RabbitMq => builder.rabbitmq(RabbitMq::new(URL).shards(SHARDS)),
    }
}

/// Dedup or inbox receipt with the trivial handler: messages per second.
async fn consume(
    db: &TestDb,
    from: &From<'_>,
    group: &str,
    mode: Mode,
    records: &[Outgoing],
) -> f64 {
    sqlx::query("TRUNCATE processed_event, inbox_event")
        .execute(&db.pool)
        .await
        .unwrap();
    if let From::RabbitMq = from {
        fill(TOPIC, group, records).await;
    }
    let consumer = builder(db, from, group)
        .await
        .handler(trivial)
        .mode(mode)
        .processors(0)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    let table = match mode {
        Mode::Dedup => "processed_event",
        Mode::Inbox => "inbox_event",
    };
    let n = records.len() as i64;
    let rate = rate_until(&db.pool, &format!("SELECT count(*) FROM {table}"), n).await;
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
    let kafka = Kafka::mock();
    let bootstrap = kafka.bootstrap();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    produce(&bootstrap, TOPIC, &records).await;
    let server = NatsServer::start().await;
    server.create_stream(STREAM, TOPIC, |_| {}).await;
    server.publish(TOPIC, &records).await;
    let db = TestDb::new().await;
    // The exchange is the topic's; the groups' names are this run's own.
    let exchange = TOPIC;
    let run = unique_name("bench");
    let (on_kafka, on_jetstream, on_rabbitmq) = (
        From::Kafka(&bootstrap),
        From::JetStream(&server),
        From::RabbitMq,
    );
    println!(
        "consumer benchmark, Kafka (mock cluster, {PARTITIONS} partitions) vs JetStream \
         (nats-server, file store) vs RabbitMQ (the machine's node, {SHARDS} quorum shard \
         queues): {n} messages, trivial handler, {rounds} rounds, autovacuum {}",
        outbox_tests::bench::autovacuum(&db.pool).await
    );
    let mut groups = Vec::new();
    let mut results: [Vec<f64>; 6] = Default::default();
    for round in 0..rounds {
        let mut group = |what: &str| {
            let name = format!("{run}-{what}-{round}");
            groups.push(name.clone());
            name
        };
        let (raw, r_dedup, r_inbox) = (group("raw"), group("r-dedup"), group("r-inbox"));
        let figures = [
            raw_rabbitmq(exchange, &raw, &records).await,
            consume(
                &db,
                &on_kafka,
                &format!("k-dedup-{round}"),
                Mode::Dedup,
                &records,
            )
            .await,
            consume(
                &db,
                &on_jetstream,
                &format!("j-dedup-{round}"),
                Mode::Dedup,
                &records,
            )
            .await,
            consume(&db, &on_rabbitmq, &r_dedup, Mode::Dedup, &records).await,
            consume(
                &db,
                &on_kafka,
                &format!("k-inbox-{round}"),
                Mode::Inbox,
                &records,
            )
            .await,
            consume(&db, &on_rabbitmq, &r_inbox, Mode::Inbox, &records).await,
        ];
        println!(
            "round {round}: amqprs alone {:.0}/s; dedup kafka {:.0}/s, jetstream {:.0}/s, \
             rabbitmq {:.0}/s; inbox receipt kafka {:.0}/s, rabbitmq {:.0}/s",
            figures[0], figures[1], figures[2], figures[3], figures[4], figures[5]
        );
        for (all, figure) in results.iter_mut().zip(figures) {
            all.push(figure);
        }
    }
    for group in &groups {
        for shard in 0..SHARDS {
            delete_queue(URL, &format!("{exchange}.{group}.{shard}")).await;
            delete_queue(URL, &format!("{exchange}.{group}.{shard}.retry")).await;
        }
    }
    delete_queue(URL, &format!("{exchange}.dlq")).await;
    delete_exchange(URL, exchange).await;
    let [raw, k_dedup, j_dedup, r_dedup, k_inbox, r_inbox] = results.map(median);
    println!("medians of {rounds} rounds (msg/s):");
    println!("  amqprs alone, consume + ack       {raw:>9.0}");
    println!(
        "  dedup         kafka {k_dedup:>9.0}   jetstream {j_dedup:>9.0} ({:.2})   rabbitmq \
         {r_dedup:>9.0} ({:.2})",
        j_dedup / k_dedup,
        r_dedup / k_dedup
    );
    println!(
        "  inbox receipt kafka {k_inbox:>9.0}   rabbitmq {r_inbox:>9.0} ({:.2})",
        r_inbox / k_inbox
    );
    println!("  rabbitmq dedup / amqprs alone: {:.2}", r_dedup / raw);
}
