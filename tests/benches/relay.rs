//! Relay throughput and latency, against its two limits, in one run on one database and broker.
//!
//! 1. the raw rdkafka producer sending N records shaped like the relay's (no database);
//! 2. the relay's database work alone: claim + mark of N rows (no Kafka);
//! 3. `publish_pending` draining N pre-written events, with 1 relay, then 4 relays, and 1 relay
//!    again with a typical W3C `traceparent` header stored on every event;
//! 4. end-to-end latency, commit to consumer receipt, at a steady 1,000 events/s.
//!
//! In the same rounds as 3, 1 and 4 relays drain a partitioned outbox (another database,
//! converted, with a week of daily partitions), reported as ratios to 3.
//!
//! `cargo bench -p outbox-tests --bench relay` (env: `N`, default 50000; `ROUNDS`, default 3;
//! `BROKER=tansu` for the tansu process instead of the embedded mock cluster; `LATENCY_SECS`,
//! default 5; `PARTITION_DAYS`, default 7: the partitioned outbox's days of partitions behind).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_runtime::relay::{self, Relay};
use outbox_runtime::Uow;
use outbox_tests::bench::{cpu_busy_since, cpu_times, env, median, rate, OrderCreated};
use outbox_tests::kafka::Kafka;
use outbox_tests::{Running, TestDb};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::PgPool;
use uuid::Uuid;

const TOPIC: &str = "bench.events";
const PARTITIONS: i32 = 12;

fn event(n: u64, keys: u64) -> OrderCreated {
    OrderCreated {
        order_id: format!("order-{}", n % keys),
        customer_id: Uuid::from_u128(n as u128),
        amount: n as i64,
        n,
    }
}

async fn write_events(pool: &PgPool, n: u64) {
    write_events_with(pool, n, false).await;
}

/// [`write_events`], each event with a `traceparent` header if `traced`.
async fn write_events_with(pool: &PgPool, n: u64, traced: bool) {
    sqlx::query("TRUNCATE outbox_event")
        .execute(pool)
        .await
        .unwrap();
    if traced {
        emit_traced(pool, n).await;
    } else {
        emit(pool, n).await;
    }
    sqlx::query("VACUUM ANALYZE outbox_event")
        .execute(pool)
        .await
        .unwrap();
}

/// Emits `n` events over 1,000 keys, 1,000 per unit of work.
async fn emit(pool: &PgPool, n: u64) {
    let mut i = 0;
    while i < n {
        let chunk: Vec<OrderCreated> = (i..(i + 1000).min(n)).map(|k| event(k, 1000)).collect();
        let mut uow = Uow::begin(pool).await.unwrap();
        uow.emit_all(&chunk).await.unwrap();
        uow.commit().await.unwrap();
        i += chunk.len() as u64;
    }
}

/// [`emit`], each event with a typical `traceparent` header (55 bytes).
async fn emit_traced(pool: &PgPool, n: u64) {
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut i = 0;
    while i < n {
        let chunk: Vec<outbox_runtime::OutboxRecord> = (i..(i + 1000).min(n))
            .map(|k| {
                outbox_runtime::OutboxRecord::from_event(&event(k, 1000))
                    .and_then(|r| r.with_headers([("traceparent", traceparent)]))
                    .unwrap()
            })
            .collect();
        let len = chunk.len() as u64;
        let mut uow = Uow::begin(pool).await.unwrap();
        uow.emit_all(chunk).await.unwrap();
        uow.commit().await.unwrap();
        i += len;
    }
}

/// How a backlog's drain is set up.
#[derive(Clone, Copy)]
enum Stats {
    /// The table was never analyzed (fresh, autovacuum behind): what a burst meets.
    Never,
    /// `ANALYZE` after the backlog was written.
    Analyzed,
}

/// (5) Drains a backlog of `n` events written into a fresh database, with 1 relay; events/s.
async fn drain_backlog(bootstrap: &str, n: u64, stats: Stats) -> f64 {
    let db = TestDb::new().await;
    emit(&db.pool, n).await;
    if let Stats::Analyzed = stats {
        sqlx::query("ANALYZE outbox_event")
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let mut config = ClientConfig::new();
    if let Ok(v) = std::env::var("INFLIGHT") {
        config.set("max.in.flight.requests.per.connection", v);
    }
    if let Ok(v) = std::env::var("LINGER") {
        config.set("linger.ms", v);
    }
    let relay = Relay::builder(db.pool.clone())
        .producer_config(config)
        .brokers(bootstrap)
        .batch_size(500)
        .build()
        .unwrap();
    let t = Instant::now();
    assert_eq!(relay.publish_pending().await.unwrap(), n);
    rate(n, t.elapsed())
}

fn producer(bootstrap: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "0")
        .create()
        .unwrap()
}

/// (1) The raw producer: the same records, no database.
async fn raw_producer(bootstrap: &str, n: u64) -> Duration {
    let producer = producer(bootstrap);
    let records: Vec<(String, String, String)> = (0..n)
        .map(|k| {
            let e = event(k, 1000);
            (
                e.order_id.clone(),
                serde_json::to_string(&e).unwrap(),
                Uuid::now_v7().to_string(),
            )
        })
        .collect();
    let start = Instant::now();
    let mut pending = Vec::with_capacity(records.len());
    for (i, (key, payload, event_id)) in records.iter().enumerate() {
        let id = i.to_string();
        let headers = OwnedHeaders::new_with_capacity(6)
            .insert(Header {
                key: "event_id",
                value: Some(event_id.as_bytes()),
            })
            .insert(Header {
                key: "event_type",
                value: Some("OrderCreated".as_bytes()),
            })
            .insert(Header {
                key: "aggregate_type",
                value: Some("Order".as_bytes()),
            })
            .insert(Header {
                key: "aggregate_id",
                value: Some(key.as_bytes()),
            })
            .insert(Header {
                key: "content-type",
                value: Some("application/json".as_bytes()),
            })
            .insert(Header {
                key: "outbox_id",
                value: Some(id.as_bytes()),
            });
        let record = FutureRecord::to(TOPIC)
            .key(key)
            .payload(payload)
            .headers(headers);
        pending.push(producer.send_result(record).map_err(|(e, _)| e).unwrap());
        // Await in windows of a relay batch, as the relay does.
        if pending.len() == 500 {
            for d in pending.drain(..) {
                d.await.unwrap().unwrap();
            }
        }
    }
    for d in pending {
        d.await.unwrap().unwrap();
    }
    start.elapsed()
}

/// (0) PostgreSQL's own marking rate: the same rows marked by plain `UPDATE`s of the relay's
/// batch size, one transaction each; no claim, no Kafka. The relay's ceiling.
async fn bare_mark(pool: &PgPool, batch: usize) -> u64 {
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox_event ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    for chunk in ids.chunks(batch) {
        let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
        sqlx::query("UPDATE outbox_event SET published_at = now() WHERE id = ANY($1)")
            .bind(chunk)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    ids.len() as u64
}

async fn wait_drained(pool: &PgPool) {
    loop {
        let left: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM outbox_event WHERE published_at IS NULL)",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if !left {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// (4) Commit → receipt latencies at a steady rate.
async fn latency(db: &TestDb, relay: &Relay, bootstrap: &str, secs: u64) -> Vec<Duration> {
    sqlx::query("TRUNCATE outbox_event")
        .execute(&db.pool)
        .await
        .unwrap();
    let running = Running::relay(relay);
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "bench-latency")
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "1")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(TOPIC, p, Offset::End).unwrap();
    }
    consumer.assign(&tpl).unwrap();
    // Let the consumer reach the end of every partition before the clock starts.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let sent: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let total = secs * 1000;
    let emitter = {
        let pool = db.pool.clone();
        let sent = sent.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            for n in 1_000_000..1_000_000 + total {
                tick.tick().await;
                let mut uow = Uow::begin(&pool).await.unwrap();
                uow.emit(&event(n, 1000)).await.unwrap();
                sent.lock().unwrap().insert(n, Instant::now());
                uow.commit().await.unwrap();
            }
        })
    };
    let mut latencies = Vec::with_capacity(total as usize);
    while latencies.len() < total as usize {
        let m = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
            .await
            .expect("latency events keep arriving")
            .unwrap();
        let received = Instant::now();
        let v: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
        let n = v["n"].as_u64().unwrap();
        if let Some(t) = sent.lock().unwrap().remove(&n) {
            latencies.push(received - t);
        }
    }
    emitter.await.unwrap();
    running.stop().await;
    latencies
}

#[tokio::main]
async fn main() {
    let n: u64 = env("N", 50_000);
    let rounds: u64 = env("ROUNDS", 3);
    let kafka = match std::env::var("BROKER").as_deref() {
        Ok("tansu") => Kafka::tansu().await,
        _ => Kafka::mock(),
    };
    let bootstrap = kafka.bootstrap();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    // An installation from before partitions: its outbox a plain table.
    let db = TestDb::before_partitions().await;
    let relay = Relay::builder(db.pool.clone())
        .brokers(&bootstrap)
        .batch_size(500)
        .build()
        .unwrap();
    // The same on a partitioned outbox (a new installation's), a week of daily partitions behind (as a
    // week's retention leaves them) and three days ahead; the events go to today's.
    let partitioned = TestDb::new().await;
    outbox_tests::fixtures::partitioned_outbox(&partitioned.pool, env("PARTITION_DAYS", 7)).await;
    let partitioned_relay = Relay::builder(partitioned.pool.clone())
        .brokers(&bootstrap)
        .batch_size(500)
        .build()
        .unwrap();
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    println!(
        "relay benchmark: N = {n} events, {rounds} rounds, broker = {kafka:?}, 1000 keys, \
         autovacuum = {autovacuum}"
    );

    let mut results: [Vec<f64>; 6] = Default::default();
    // The partitioned outbox's rates as ratios to the plain one's of the same round.
    let mut ratios: [Vec<f64>; 2] = Default::default();
    for round in 0..rounds {
        let raw = rate(n, raw_producer(&bootstrap, n).await);

        write_events(&db.pool, n).await;
        let t = Instant::now();
        let cpu = cpu_times();
        assert_eq!(bare_mark(&db.pool, 500).await, n);
        let bare = rate(n, t.elapsed());
        let bare_cpu = cpu_busy_since(cpu);

        write_events(&db.pool, n).await;
        let t = Instant::now();
        let marked = relay::drain_without_broker(db.pool.clone(), 500)
            .await
            .unwrap();
        assert_eq!(marked, n);
        let db_only = rate(n, t.elapsed());

        write_events(&db.pool, n).await;
        let t = Instant::now();
        let cpu = cpu_times();
        let published = relay.publish_pending().await.unwrap();
        assert_eq!(published, n);
        let one = rate(n, t.elapsed());
        let one_cpu = cpu_busy_since(cpu);

        write_events(&db.pool, n).await;
        let t = Instant::now();
        let cpu = cpu_times();
        let relays: Vec<_> = (0..4).map(|_| Running::relay(&relay)).collect();
        wait_drained(&db.pool).await;
        let four = rate(n, t.elapsed());
        let four_cpu = cpu_busy_since(cpu);
        Running::stop_all(relays).await;
        write_events_with(&db.pool, n, true).await;
        let t = Instant::now();
        let published = relay.publish_pending().await.unwrap();
        assert_eq!(published, n);
        let traced = rate(n, t.elapsed());

        write_events(&partitioned.pool, n).await;
        let t = Instant::now();
        assert_eq!(partitioned_relay.publish_pending().await.unwrap(), n);
        let one_partitioned = rate(n, t.elapsed());
        write_events(&partitioned.pool, n).await;
        let t = Instant::now();
        let relays: Vec<_> = (0..4).map(|_| Running::relay(&partitioned_relay)).collect();
        wait_drained(&partitioned.pool).await;
        let four_partitioned = rate(n, t.elapsed());
        Running::stop_all(relays).await;
        println!(
            "round {round}: bare mark {bare:.0}/s (CPU {:.0}%), raw producer {raw:.0}/s, \
             claim+mark only {db_only:.0}/s, 1 relay {one:.0}/s (CPU {:.0}%), \
             4 relays {four:.0}/s (CPU {:.0}%), 1 relay with traceparent {traced:.0}/s, \
             partitioned: 1 relay {one_partitioned:.0}/s ({:.2} x), 4 relays \
             {four_partitioned:.0}/s ({:.2} x)",
            bare_cpu * 100.0,
            one_cpu * 100.0,
            four_cpu * 100.0,
            one_partitioned / one,
            four_partitioned / four
        );
        ratios[0].push(one_partitioned / one);
        ratios[1].push(four_partitioned / four);
        for (i, r) in [bare, raw, db_only, one, four, traced]
            .into_iter()
            .enumerate()
        {
            results[i].push(r);
        }
    }
    let [bare, raw, db_only, one, four, traced] = results.map(median);
    let limit = raw.min(db_only);
    println!();
    println!("medians over {rounds} rounds (events/s):");
    println!("  (0) bare mark (UPDATE in batches of 500) {bare:>9.0}");
    println!("  (1) raw rdkafka producer, no database   {raw:>9.0}");
    println!("  (2) claim + mark only, no Kafka         {db_only:>9.0}");
    println!(
        "  (3) publish_pending, 1 relay            {one:>9.0}   {:.0}% of min(1, 2), {:.2} x bare mark",
        one / limit * 100.0,
        one / bare
    );
    println!(
        "      4 relays                            {four:>9.0}   {:.0}% of min(1, 2), {:.2} x bare mark",
        four / limit * 100.0,
        four / bare
    );
    println!(
        "      1 relay, a traceparent on each      {traced:>9.0}   {:.2} x 1 relay",
        traced / one
    );
    let [one_ratio, four_ratio] = ratios.map(median);
    println!(
        "      partitioned outbox: 1 relay {one_ratio:.2} x, 4 relays {four_ratio:.2} x the \
         plain one (medians of the rounds' ratios)"
    );

    // (5) Backlogs and statistics: a large backlog on a table the planner knows nothing about,
    // the same after ANALYZE, a small one; and a slow broker.
    let large: u64 = env("BACKLOG", 1_000_000);
    let small: u64 = env("SMALL_BACKLOG", 50_000);
    let small_never = drain_backlog(&bootstrap, small, Stats::Never).await;
    let large_never = drain_backlog(&bootstrap, large, Stats::Never).await;
    let large_analyzed = drain_backlog(&bootstrap, large, Stats::Analyzed).await;
    println!("  (5) drain of {small} rows, never analyzed {small_never:>9.0}");
    println!(
        "      drain of {large} rows, never analyzed {large_never:>9.0}   {:.2} x analyzed, {:.2} x {small} rows",
        large_never / large_analyzed,
        large_never / small_never
    );
    println!("      drain of {large} rows, analyzed     {large_analyzed:>9.0}");
    if matches!(kafka, Kafka::Mock(_)) {
        let delay = Duration::from_millis(env("SLOW_MS", 5));
        kafka.set_latency(delay);
        let slow = drain_backlog(&bootstrap, small, Stats::Never).await;
        kafka.set_latency(Duration::ZERO);
        println!(
            "  (6) drain of {small} rows, broker {delay:?} slower {slow:>9.0}   {:.2} x the same at full speed",
            slow / small_never
        );
    }

    let secs: u64 = env("LATENCY_SECS", 5);
    let mut lat = latency(&db, &relay, &bootstrap, secs).await;
    lat.sort();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    println!(
        "  (4) commit -> consumer latency at 1000 events/s over {secs} s: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        pct(0.50).as_secs_f64() * 1e3,
        pct(0.99).as_secs_f64() * 1e3,
        lat[lat.len() - 1].as_secs_f64() * 1e3
    );
}
