//! The relay to RabbitMQ beside the relay to Kafka (librdkafka's mock cluster, the baseline)
//! and to NATS JetStream, in one run on one database, so that the ratios mean something on a
//! noisy machine:
//!
//! 1. amqprs alone publishing N messages shaped like the relay's (persistent, `mandatory`,
//!    headers, on a confirm channel with up to 1,000 confirms outstanding): RabbitMQ's ceiling
//!    on this machine;
//! 2. `publish_pending` draining N pre-written events: 1 relay, then 4 relays, to each broker
//!    (and to RabbitMQ 4 relays built apart: a connection and channel each, where the
//!    instances of one relay share one);
//! 3. the bad case, a few hot keys: N events over 10 keys, 1 relay to each broker (on JetStream
//!    and RabbitMQ a key's records go one at a time; on Kafka they are pipelined).
//!
//! `cargo bench -p outbox-tests --bench relay_rabbitmq` (env: `N`, default 20000; `ROUNDS`,
//! default 3). RabbitMQ: the machine's shared node (`SHARED_URL`), an exchange of the run's own
//! with one classic durable queue bound for every shard (emptied after each drain, deleted at
//! the end); JetStream: a nats-server of the bench's own (file store).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amqprs::callbacks::ChannelCallback;
use amqprs::channel::{BasicPublishArguments, Channel, ConfirmSelectArguments};
use amqprs::connection::{Connection, OpenConnectionArguments};
use amqprs::{
    Ack, BasicProperties, Cancel, CloseChannel, FieldTable, FieldValue, Nack, Return,
    DELIVERY_MODE_PERSISTENT,
};
use outbox_runtime::rabbitmq::RabbitMq;
use outbox_runtime::relay::{JetStream, Relay};
use outbox_tests::bench::{env, median, rate, wait_drained, write_events};
use outbox_tests::kafka::Kafka;
use outbox_tests::nats::NatsServer;
use outbox_tests::rabbitmq::{self as mq, SHARED_URL};
use outbox_tests::{Running, TestDb};
use sqlx::PgPool;
use uuid::Uuid;

const SHARDS: u16 = 4;

/// Where the run's RabbitMQ messages go: its exchange and one queue bound for every shard.
struct Rabbit {
    exchange: String,
    queue: String,
}

impl Rabbit {
    /// Empties the queue (deleted and declared again: nothing piles up between drains).
    async fn empty(&self) {
        mq::delete_queue(SHARED_URL, &self.queue).await;
        mq::declare_queue_for_all_shards(SHARED_URL, &self.queue, &self.exchange, SHARDS).await;
    }
}

/// Counts the confirms of a channel.
#[derive(Clone, Default)]
struct Confirmed(Arc<(AtomicU64, tokio::sync::Notify)>);

type Boxed<'a, T> = Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// `ChannelCallback` is an `async_trait` trait: written out as that macro would.
impl ChannelCallback for Confirmed {
    fn close<'s, 'c, 'a>(
        &'s mut self,
        _: &'c Channel,
        close: CloseChannel,
    ) -> Boxed<'a, Result<(), amqprs::error::Error>>
    where
        's: 'a,
        'c: 'a,
        Self: 'a,
    {
        panic!("RabbitMQ closed the benchmark's channel: {close}");
    }
    fn cancel<'s, 'c, 'a>(
        &'s mut self,
        _: &'c Channel,
        _: Cancel,
    ) -> Boxed<'a, Result<(), amqprs::error::Error>>
    where
        's: 'a,
        'c: 'a,
        Self: 'a,
    {
        Box::pin(async { Ok(()) })
    }
    fn flow<'s, 'c, 'a>(
        &'s mut self,
        _: &'c Channel,
        active: bool,
    ) -> Boxed<'a, Result<bool, amqprs::error::Error>>
    where
        's: 'a,
        'c: 'a,
        Self: 'a,
    {
        Box::pin(async move { Ok(active) })
    }
    fn publish_ack<'s, 'c, 'a>(&'s mut self, _: &'c Channel, ack: Ack) -> Boxed<'a, ()>
    where
        's: 'a,
        'c: 'a,
        Self: 'a,
    {
        // Tags count from 1: the highest tag confirmed is how many are.
        self.0 .0.fetch_max(ack.delivery_tag(), Ordering::SeqCst);
        self.0 .1.notify_waiters();
        Box::pin(async {})
    }
    fn publish_nack<'s, 'c, 'a>(&'s mut self, _: &'c Channel, _: Nack) -> Boxed<'a, ()>
    where
        's: 'a,
        'c: 'a,
        Self: 'a,
    {
        panic!("RabbitMQ refused a benchmark message");
    }
    fn publish_return<'s, 'c, 'a>(
        &'s mut self,
        _: &'c Channel,
        _: Return,
        _: BasicProperties,
        _: Vec<u8>,
    ) -> Boxed<'a, ()>
    where
        's: 'a,
        'c: 'a,
        Self: 'a,
    {
        panic!("a benchmark message was unroutable");
    }
}

impl Confirmed {
    /// Waits until at least `n` are confirmed.
    async fn at_least(&self, n: u64) {
        loop {
            let notified = self.0 .1.notified();
            if self.0 .0.load(Ordering::SeqCst) >= n {
                return;
            }
            notified.await;
        }
    }
}

/// amqprs alone: `n` messages like the relay's, confirms awaited with at most 1,000
/// outstanding.
async fn raw_rabbitmq(rabbit: &Rabbit, n: u64) -> Duration {
    let args = OpenConnectionArguments::try_from(SHARED_URL).unwrap();
    let connection = Connection::open(&args).await.unwrap();
    let channel = connection.open_channel(None).await.unwrap();
    let confirmed = Confirmed::default();
    channel.register_callback(confirmed.clone()).await.unwrap();
    channel
        .confirm_select(ConfirmSelectArguments::default())
        .await
        .unwrap();
    let payload = serde_json::to_vec(&serde_json::json!({
        "order_id": "order-1", "customer_id": Uuid::nil(), "amount": 1, "n": 1
    }))
    .unwrap();
    let t = Instant::now();
    for i in 0..n {
        let id = Uuid::new_v4().to_string();
        let key = format!("order-{}", i % 1000);
        let mut headers = FieldTable::new();
        for (name, value) in [
            ("event_id", id.as_str()),
            ("event_type", "OrderCreated"),
            ("aggregate_type", "Order"),
            ("aggregate_id", key.as_str()),
            ("content-type", "application/json"),
            ("outbox_id", &i.to_string()),
            ("outbox_key", key.as_str()),
            ("outbox_timestamp_ms", "1700000000000"),
        ] {
            headers.insert(name.try_into().unwrap(), FieldValue::from(value));
        }
        let mut properties = BasicProperties::default();
        properties
            .with_message_id(&id)
            .with_content_type("application/json")
            .with_delivery_mode(DELIVERY_MODE_PERSISTENT)
            .with_headers(headers);
        let mut publish = BasicPublishArguments::new(&rabbit.exchange, &(i % 4).to_string());
        publish.mandatory(true);
        channel
            .basic_publish(properties, payload.clone(), publish)
            .await
            .unwrap();
        if i >= 1000 {
            confirmed.at_least(i + 1 - 1000).await;
        }
    }
    confirmed.at_least(n).await;
    let elapsed = t.elapsed();
    let _ = channel.close().await;
    let _ = connection.close().await;
    elapsed
}

/// Drains `n` events with one `publish_pending`, then with 4 running instances: the two rates.
async fn drain(pool: &PgPool, relay: &Relay, n: u64) -> (f64, f64) {
    write_events(pool, n, 1000).await;
    let t = Instant::now();
    assert_eq!(relay.publish_pending().await.unwrap(), n);
    let one = rate(n, t.elapsed());
    write_events(pool, n, 1000).await;
    let t = Instant::now();
    let relays: Vec<_> = (0..4).map(|_| Running::relay(relay)).collect();
    wait_drained(pool).await;
    let four = rate(n, t.elapsed());
    Running::stop_all(relays).await;
    (one, four)
}

/// Drains `n` events with 4 relays built apart (a RabbitMQ connection and channel each, where
/// the instances of one relay share one).
async fn drain_apart(pool: &PgPool, relays: &[Relay], n: u64) -> f64 {
    write_events(pool, n, 1000).await;
    let t = Instant::now();
    let running: Vec<_> = relays.iter().map(Running::relay).collect();
    wait_drained(pool).await;
    let four = rate(n, t.elapsed());
    Running::stop_all(running).await;
    four
}

/// One `publish_pending` of `n` events over 10 keys.
async fn hot_keys(pool: &PgPool, relay: &Relay, n: u64) -> f64 {
    write_events(pool, n, 10).await;
    let t = Instant::now();
    assert_eq!(relay.publish_pending().await.unwrap(), n);
    rate(n, t.elapsed())
}

#[tokio::main]
async fn main() {
    let n: u64 = env("N", 20_000);
    let rounds: u64 = env("ROUNDS", 3);
    let db = TestDb::new().await;
    // The run's own topic (the exchange's name on the shared node), for every broker.
    let topic = mq::unique_name("bench");
    for sql in [
        format!(
            "CREATE FUNCTION bench_topic() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN NEW.topic := '{topic}'; RETURN NEW; END $$"
        ),
        "CREATE TRIGGER bench_topic BEFORE INSERT ON outbox_event FOR EACH ROW \
         EXECUTE FUNCTION bench_topic()"
            .to_owned(),
    ] {
        sqlx::query(&sql).execute(&db.pool).await.unwrap();
    }
    let kafka = Kafka::mock();
    kafka.create_topic(&topic, 12).await;
    let server = NatsServer::start().await;
    server.create_stream("BENCH", &topic, |_| {}).await;
    let rabbit = Rabbit {
        queue: format!("{topic}.read"),
        exchange: topic.clone(),
    };
    rabbit.empty().await;
    let to_kafka = Relay::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .build()
        .unwrap();
    let to_jetstream = Relay::builder(db.pool.clone())
        .jetstream(JetStream::new(server.client().await))
        .build()
        .unwrap();
    let to_rabbitmq = Relay::builder(db.pool.clone())
        .rabbitmq(RabbitMq::new(SHARED_URL).shards(SHARDS))
        .build()
        .unwrap();
    let apart: Vec<Relay> = (0..4)
        .map(|_| {
            Relay::builder(db.pool.clone())
                .rabbitmq(RabbitMq::new(SHARED_URL).shards(SHARDS))
                .build()
                .unwrap()
        })
        .collect();
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    println!(
        "RabbitMQ relay benchmark: N = {n} events, {rounds} rounds, 1000 keys (10 for the hot \
         keys), batch 500, RabbitMQ: the shared node ({SHARDS} shards, one classic durable \
         queue), JetStream: nats-server file store, Kafka: the mock cluster, autovacuum = \
         {autovacuum}"
    );
    let mut results: [Vec<f64>; 11] = Default::default();
    for round in 0..rounds {
        let raw = rate(n, raw_rabbitmq(&rabbit, n).await);
        rabbit.empty().await;
        let (kafka_one, kafka_four) = drain(&db.pool, &to_kafka, n).await;
        let (js_one, js_four) = drain(&db.pool, &to_jetstream, n).await;
        let (mq_one, mq_four) = drain(&db.pool, &to_rabbitmq, n).await;
        rabbit.empty().await;
        let mq_apart = drain_apart(&db.pool, &apart, n).await;
        rabbit.empty().await;
        let kafka_hot = hot_keys(&db.pool, &to_kafka, n).await;
        let js_hot = hot_keys(&db.pool, &to_jetstream, n).await;
        let mq_hot = hot_keys(&db.pool, &to_rabbitmq, n).await;
        rabbit.empty().await;
        println!(
            "round {round}: amqprs alone {raw:.0}/s; 1 relay: Kafka {kafka_one:.0}/s, JetStream \
             {js_one:.0}/s, RabbitMQ {mq_one:.0}/s; 4 relays: Kafka {kafka_four:.0}/s, \
             JetStream {js_four:.0}/s, RabbitMQ {mq_four:.0}/s (built apart {mq_apart:.0}/s); \
             10 hot keys: Kafka {kafka_hot:.0}/s, JetStream {js_hot:.0}/s, RabbitMQ {mq_hot:.0}/s"
        );
        let figures = [
            raw, kafka_one, js_one, mq_one, kafka_four, js_four, mq_four, kafka_hot, js_hot,
            mq_hot, mq_apart,
        ];
        for (i, r) in figures.into_iter().enumerate() {
            results[i].push(r);
        }
    }
    let medians = results.map(median);
    let [raw, kafka_one, js_one, mq_one, kafka_four, js_four, mq_four] =
        medians[..7].try_into().unwrap();
    let [kafka_hot, js_hot, mq_hot, mq_apart] = medians[7..].try_into().unwrap();
    mq::delete_queue(SHARED_URL, &rabbit.queue).await;
    mq::delete_exchange(SHARED_URL, &rabbit.exchange).await;
    println!();
    println!("medians of {rounds} rounds:");
    println!("  amqprs alone (RabbitMQ's ceiling here) {raw:>8.0}/s");
    println!(
        "  | relays | Kafka (mock) | JetStream | RabbitMQ | JetStream / Kafka | RabbitMQ / Kafka \
         | RabbitMQ / ceiling |"
    );
    println!("  |---|---|---|---|---|---|---|");
    for (what, k, j, r) in [
        ("1", kafka_one, js_one, mq_one),
        ("4", kafka_four, js_four, mq_four),
        ("1, 10 hot keys", kafka_hot, js_hot, mq_hot),
    ] {
        println!(
            "  | {what} | {k:.0}/s | {j:.0}/s | {r:.0}/s | {:.2} | {:.2} | {:.2} |",
            j / k,
            r / k,
            r / raw
        );
    }
    println!(
        "  RabbitMQ, 4 relays built apart (a channel each): {mq_apart:.0}/s, {:.2} of the 4 \
         instances of one relay (one channel)",
        mq_apart / mq_four
    );
}
