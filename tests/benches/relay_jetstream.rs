//! The relay to NATS JetStream beside the relay to Kafka (librdkafka's mock cluster), in one run
//! on one database, so that the ratios mean something on a noisy machine:
//!
//! 1. async-nats alone publishing N messages shaped like the relay's (headers, `Nats-Msg-Id`,
//!    up to 1,000 acknowledgements outstanding): JetStream's ceiling on this machine;
//! 2. `publish_pending` draining N pre-written events to Kafka: 1 relay, then 4 relays (the
//!    baseline);
//! 3. the same to JetStream;
//! 4. the bad case for JetStream, a few hot keys: N events over 10 keys, 1 relay to each broker,
//!    then 4 (Kafka: 4 instances of one relay; JetStream: 4 relays, each with a connection of
//!    its own, so that their messages interleave in the stream and break each other's chains of
//!    expected message ids).
//!
//! `cargo bench -p outbox-tests --bench relay_jetstream` (env: `N`, default 20000; `ROUNDS`,
//! default 3). It starts its own nats-server (a file store in a temporary directory).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use async_nats::jetstream::message::PublishMessage;
use outbox_runtime::relay::{JetStream, Relay};
use outbox_tests::bench::{env, median, rate, wait_drained, write_events};
use outbox_tests::kafka::Kafka;
use outbox_tests::nats::NatsServer;
use outbox_tests::{Running, TestDb};
use sqlx::PgPool;
use uuid::Uuid;

const TOPIC: &str = "bench.events";

/// async-nats alone: `n` messages like the relay's, acknowledgements awaited in order with at
/// most 1,000 outstanding.
async fn raw_jetstream(server: &NatsServer, n: u64) -> Duration {
    let js = server.jetstream().await;
    let payload = bytes_of(&serde_json::json!({
        "order_id": "order-1", "customer_id": Uuid::nil(), "amount": 1, "n": 1
    }));
    let t = Instant::now();
    let mut outstanding = VecDeque::new();
    for i in 0..n {
        let id = Uuid::new_v4().to_string();
        let message = PublishMessage::build()
            .header("event_id", id.as_str())
            .header("event_type", "OrderCreated")
            .header("aggregate_type", "Order")
            .header("aggregate_id", format!("order-{}", i % 1000).as_str())
            .header("content-type", "application/json")
            .header("outbox_id", i.to_string().as_str())
            .header("outbox_key", format!("order-{}", i % 1000).as_str())
            .message_id(&id)
            .payload(payload.clone());
        outstanding.push_back(js.send_publish(TOPIC, message).await.unwrap());
        if outstanding.len() >= 1000 {
            outstanding.pop_front().unwrap().await.unwrap();
        }
    }
    for ack in outstanding {
        ack.await.unwrap();
    }
    t.elapsed()
}

fn bytes_of(value: &serde_json::Value) -> bytes::Bytes {
    bytes::Bytes::from(serde_json::to_vec(value).unwrap())
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

/// One `publish_pending` of `n` events over 10 keys.
async fn hot_keys(pool: &PgPool, relay: &Relay, n: u64) -> f64 {
    write_events(pool, n, 10).await;
    let t = Instant::now();
    assert_eq!(relay.publish_pending().await.unwrap(), n);
    rate(n, t.elapsed())
}

/// `n` events over 10 keys drained by an instance of each of `relays`.
async fn hot_keys_four(pool: &PgPool, relays: &[&Relay], n: u64) -> f64 {
    write_events(pool, n, 10).await;
    let t = Instant::now();
    let running: Vec<_> = relays.iter().map(|r| Running::relay(r)).collect();
    wait_drained(pool).await;
    let four = rate(n, t.elapsed());
    Running::stop_all(running).await;
    four
}

#[tokio::main]
async fn main() {
    let n: u64 = env("N", 20_000);
    let rounds: u64 = env("ROUNDS", 3);
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 12).await;
    let server = NatsServer::start().await;
    server.create_stream("BENCH", TOPIC, |_| {}).await;
    let db = TestDb::new().await;
    let to_kafka = Relay::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .build()
        .unwrap();
    let to_jetstream = Relay::builder(db.pool.clone())
        .jetstream(JetStream::new(server.client().await))
        .build()
        .unwrap();
    let mut four_to_jetstream = Vec::new();
    for _ in 0..4 {
        four_to_jetstream.push(
            Relay::builder(db.pool.clone())
                .jetstream(JetStream::new(server.client().await))
                .build()
                .unwrap(),
        );
    }
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    println!(
        "JetStream relay benchmark: N = {n} events, {rounds} rounds, 1000 keys (10 for the hot \
         keys), batch 500, nats-server file store, Kafka: the mock cluster, autovacuum = \
         {autovacuum}"
    );
    let mut results: [Vec<f64>; 9] = Default::default();
    for round in 0..rounds {
        let raw = rate(n, raw_jetstream(&server, n).await);
        let (kafka_one, kafka_four) = drain(&db.pool, &to_kafka, n).await;
        let (js_one, js_four) = drain(&db.pool, &to_jetstream, n).await;
        let kafka_hot = hot_keys(&db.pool, &to_kafka, n).await;
        let js_hot = hot_keys(&db.pool, &to_jetstream, n).await;
        let kafka_hot_four = hot_keys_four(&db.pool, &[&to_kafka; 4], n).await;
        let js_hot_four =
            hot_keys_four(&db.pool, &four_to_jetstream.iter().collect::<Vec<_>>(), n).await;
        println!(
            "round {round}: async-nats alone {raw:.0}/s; Kafka 1 relay {kafka_one:.0}/s, 4 \
             relays {kafka_four:.0}/s; JetStream 1 relay {js_one:.0}/s, 4 relays \
             {js_four:.0}/s; 10 hot keys: Kafka {kafka_hot:.0}/s, JetStream {js_hot:.0}/s; \
             10 hot keys, 4 relays: Kafka {kafka_hot_four:.0}/s, JetStream {js_hot_four:.0}/s"
        );
        for (i, r) in [
            raw,
            kafka_one,
            kafka_four,
            js_one,
            js_four,
            kafka_hot,
            js_hot,
            kafka_hot_four,
            js_hot_four,
        ]
        .into_iter()
        .enumerate()
        {
            results[i].push(r);
        }
    }
    let [raw, kafka_one, kafka_four, js_one, js_four, kafka_hot, js_hot, kafka_hot_four, js_hot_four] =
        results.map(median);
    println!();
    println!("medians of {rounds} rounds:");
    println!("  async-nats alone (JetStream's ceiling here) {raw:>8.0}/s");
    println!("  | relays | Kafka (mock) | JetStream | JetStream / Kafka | JetStream / ceiling |");
    println!("  |---|---|---|---|---|");
    for (what, k, j) in [
        ("1", kafka_one, js_one),
        ("4", kafka_four, js_four),
        ("1, 10 hot keys", kafka_hot, js_hot),
        ("4, 10 hot keys", kafka_hot_four, js_hot_four),
    ] {
        println!(
            "  | {what} | {k:.0}/s | {j:.0}/s | {:.2} | {:.2} |",
            j / k,
            j / raw
        );
    }
}
