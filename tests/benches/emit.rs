//! What an emit adds to a command transaction.
//!
//! Runs, on one fresh database in one process, a transaction with one domain INSERT alone, with
//! one `emit`, with one `emit` carrying a W3C `traceparent` header (given, and captured from an
//! OpenTelemetry span), with one `emit` while a relay waits for work (so the commit notifies),
//! with one `emit` while a relay runs (on the in-process mock cluster), with `emit_all` of
//! 10 events, and with `emit` and `emit_all` of 10 into a partitioned outbox (a second
//! database, converted, with a week of daily partitions), at concurrency 1 and 8. The variants are
//! interleaved round by round so that the machine's noise hits them alike; the figures are
//! medians over rounds.
//!
//! `cargo bench -p outbox-tests --bench emit` (env: `ROUNDS`, default 7; `TXS`, transactions
//! per task per round, default 300).

use std::time::Duration;

use outbox_runtime::relay::Relay;
use outbox_runtime::Uow;
use outbox_tests::bench::{concurrent_calls, env, median, percentile};
use outbox_tests::fixtures::OrderCreated;
use outbox_tests::kafka::Kafka;
use outbox_tests::{count, Running, TestDb};
use sqlx::PgPool;
use uuid::Uuid;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    NoEmit,
    /// The floor: the same outbox row written by a plain parameterized INSERT in a plain sqlx
    /// transaction; no function, no lock, no notify check, no unit of work.
    HandInsert,
    Emit1,
    /// The row written at once (its own round trip), as an insert-at-emit design would.
    Emit1Flush,
    EmitAll10,
    /// One emit with a typical `traceparent` header given to `emit_with` (stored, the
    /// 8-argument `outbox_emit`).
    Emit1Traceparent,
    /// One emit inside an OpenTelemetry span (a `tracing-opentelemetry` layer, no exporter):
    /// the span's creation and the capture of its context at emit.
    Emit1Traced,
    /// One emit while a relay waits for work (registered in `outbox_relay_waiting`, its
    /// listener drained): every commit sends a NOTIFY.
    Emit1Notify,
    /// One emit while a relay runs (on the in-process mock cluster), idle when the round
    /// starts: it notifies as the relay asks.
    Emit1Relay,
    /// [`Variant::Emit1`] into a partitioned outbox (another database, converted, with a week
    /// of daily partitions behind and three days ahead).
    Emit1Partitioned,
    /// [`Variant::EmitAll10`] into the partitioned outbox.
    EmitAll10Partitioned,
}

/// A typical W3C `traceparent` (55 bytes).
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// A dispatcher with an OpenTelemetry layer, for [`Variant::Emit1Traced`] only (the other
/// variants run without a subscriber).
fn traced_dispatch() -> tracing::Dispatch {
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    static DISPATCH: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
    DISPATCH
        .get_or_init(|| {
            let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
            let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("bench"));
            tracing::Dispatch::new(tracing_subscriber::registry().with(layer))
        })
        .clone()
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::NoEmit => "insert only",
            Variant::HandInsert => "insert + hand-written INSERT",
            Variant::Emit1 => "insert + emit",
            Variant::Emit1Flush => "insert + emit + flush",
            Variant::EmitAll10 => "insert + emit_all(10)",
            Variant::Emit1Traceparent => "insert + emit, traceparent",
            Variant::Emit1Traced => "insert + emit, OTel span",
            Variant::Emit1Notify => "insert + emit, relay waiting",
            Variant::Emit1Relay => "insert + emit, relay running",
            Variant::Emit1Partitioned => "insert + emit, partitioned",
            Variant::EmitAll10Partitioned => "insert + emit_all(10), partitioned",
        }
    }

    fn partitioned(self) -> bool {
        matches!(
            self,
            Variant::Emit1Partitioned | Variant::EmitAll10Partitioned
        )
    }
}

async fn command(pool: &PgPool, variant: Variant) {
    if variant == Variant::Emit1Traced {
        use tracing::instrument::WithSubscriber as _;
        use tracing::Instrument as _;
        let pool = pool.clone();
        return async move {
            let span = tracing::info_span!("request");
            command_untraced(&pool, Variant::Emit1)
                .instrument(span)
                .await
        }
        .with_subscriber(traced_dispatch())
        .await;
    }
    command_untraced(pool, variant).await
}

async fn command_untraced(pool: &PgPool, variant: Variant) {
    let order = OrderCreated {
        order_id: Uuid::now_v7(),
        customer_id: Uuid::now_v7(),
        amount: 100,
    };
    if variant == Variant::HandInsert {
        return hand_insert(pool, &order).await;
    }
    let mut uow = Uow::begin(pool).await.unwrap();
    sqlx::query("INSERT INTO orders (id, customer_id, amount) VALUES ($1, $2, $3)")
        .bind(order.order_id)
        .bind(order.customer_id)
        .bind(order.amount)
        .execute(uow.tx())
        .await
        .unwrap();
    match variant {
        Variant::NoEmit | Variant::HandInsert | Variant::Emit1Traced => {}
        Variant::Emit1Traceparent => {
            uow.emit_with(&order, [("traceparent", TRACEPARENT)])
                .await
                .unwrap();
        }
        Variant::Emit1 | Variant::Emit1Notify | Variant::Emit1Relay | Variant::Emit1Partitioned => {
            uow.emit(&order).await.unwrap();
        }
        Variant::Emit1Flush => {
            uow.emit(&order).await.unwrap();
            uow.flush().await.unwrap();
        }
        Variant::EmitAll10 | Variant::EmitAll10Partitioned => {
            let lines: Vec<OrderCreated> = (0..10)
                .map(|i| OrderCreated {
                    order_id: order.order_id,
                    customer_id: order.customer_id,
                    amount: i,
                })
                .collect();
            uow.emit_all(&lines).await.unwrap();
        }
    }
    uow.commit().await.unwrap();
}

/// The domain row and the same outbox row as `emit` writes, by hand.
async fn hand_insert(pool: &PgPool, order: &OrderCreated) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (id, customer_id, amount) VALUES ($1, $2, $3)")
        .bind(order.order_id)
        .bind(order.customer_id)
        .bind(order.amount)
        .execute(&mut *tx)
        .await
        .unwrap();
    let record = outbox_runtime::OutboxRecord::from_event(order).unwrap();
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key) \
         VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7)",
    )
    .bind(record.event_id())
    .bind(record.aggregate_type())
    .bind(record.aggregate_id())
    .bind(record.event_type())
    .bind(record.payload())
    .bind(record.topic())
    .bind(record.partition_key())
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

/// What a relay waiting for work leaves: its mark in `outbox_relay_waiting` (so that every
/// emit notifies), and its listener, read all the time. Abort the task and delete the mark to
/// undo.
async fn relay_waiting(pool: &PgPool) -> tokio::task::JoinHandle<()> {
    sqlx::query("INSERT INTO outbox_relay_waiting (slot) VALUES (4095)")
        .execute(pool)
        .await
        .unwrap();
    let mut listener = sqlx::postgres::PgListener::connect_with(pool)
        .await
        .unwrap();
    listener.listen("outbox_event").await.unwrap();
    tokio::spawn(async move { while listener.recv().await.is_ok() {} })
}

/// What some variants need beside the emitters' pool.
struct Aside {
    /// For the listener of [`Variant::Emit1Notify`] and the relay's status.
    pool: PgPool,
    /// The relay of [`Variant::Emit1Relay`].
    relay: Relay,
    /// The emitters' pool on the database with a partitioned outbox.
    partitioned: PgPool,
}

/// Runs `txs` transactions in each of `concurrency` tasks (on `pool`); returns (tx/s, per-tx
/// latencies).
async fn round(
    pool: &PgPool,
    aside: &Aside,
    variant: Variant,
    concurrency: usize,
    txs: usize,
) -> (f64, Vec<Duration>) {
    // A relay waiting: its mark, and a listener that reads every notification.
    let listener = if variant == Variant::Emit1Notify {
        Some(relay_waiting(&aside.pool).await)
    } else {
        None
    };
    // A relay running, idle: what other variants left published first.
    let relay = if variant == Variant::Emit1Relay {
        aside.relay.publish_pending().await.unwrap();
        let running = Running::relay(&aside.relay);
        while count(&aside.pool, "SELECT count(*) FROM outbox_relay_waiting").await == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Some(running)
    } else {
        None
    };
    let pool = if variant.partitioned() {
        &aside.partitioned
    } else {
        pool
    };
    let emitters = pool.clone();
    let (rate, latencies) = concurrent_calls(concurrency, txs, move || {
        let pool = emitters.clone();
        async move { command(&pool, variant).await }
    })
    .await;
    if let Some(listener) = listener {
        listener.abort();
        sqlx::query("DELETE FROM outbox_relay_waiting")
            .execute(pool)
            .await
            .unwrap();
    }
    if let Some(running) = relay {
        running.stop().await;
    }
    (rate, latencies)
}

#[tokio::main]
async fn main() {
    let rounds: usize = env("ROUNDS", 7);
    let txs: usize = env("TXS", 300);
    // An installation from before partitions (its outbox a plain table), and a new one.
    let db = TestDb::before_partitions().await;
    let partitioned = TestDb::new().await;
    for pool in [&db.pool, &partitioned.pool] {
        sqlx::query("CREATE TABLE orders (id uuid PRIMARY KEY, customer_id uuid NOT NULL, amount bigint NOT NULL)")
            .execute(pool)
            .await
            .unwrap();
    }
    outbox_tests::fixtures::partitioned_outbox(&partitioned.pool, 7).await;
    let pool = db.pool(8).await;
    let kafka = Kafka::mock();
    kafka.create_topic("order.events", 6).await;
    let aside = Aside {
        pool: db.pool.clone(),
        relay: Relay::builder(db.pool.clone())
            .brokers(kafka.bootstrap())
            .build()
            .unwrap(),
        partitioned: partitioned.pool(8).await,
    };
    let variants = [
        Variant::NoEmit,
        Variant::HandInsert,
        Variant::Emit1,
        Variant::Emit1Flush,
        Variant::EmitAll10,
        Variant::Emit1Traceparent,
        Variant::Emit1Traced,
        Variant::Emit1Notify,
        Variant::Emit1Relay,
        Variant::Emit1Partitioned,
        Variant::EmitAll10Partitioned,
    ];
    let n = variants.len();
    println!("emit overhead: {rounds} rounds x {txs} transactions per task, medians over rounds");
    println!(
        "{:>11} | {:<28} | {:>9} | {:>12} | {:>12} | {:>14} | {:>6}",
        "concurrency",
        "transaction",
        "tx/s",
        "p50 latency",
        "p99 latency",
        "time vs insert",
        "x floor"
    );
    for concurrency in [1, 8] {
        // Warm-up: connections open, statements prepared.
        for v in variants {
            round(&pool, &aside, v, concurrency, 20).await;
        }
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); n];
        let mut lats: Vec<Vec<Duration>> = vec![Vec::new(); n];
        for r in 0..rounds {
            // Rotate the order each round so that no variant always runs first.
            for k in 0..n {
                let i = (k + r) % n;
                let (rate, l) = round(&pool, &aside, variants[i], concurrency, txs).await;
                rates[i].push(rate);
                lats[i].extend(l);
            }
        }
        let base = median(rates[0].clone());
        let floor = median(rates[1].clone());
        for i in 0..n {
            let rate = median(rates[i].clone());
            let p50 = percentile(&mut lats[i], 0.50);
            let p99 = percentile(&mut lats[i], 0.99);
            println!(
                "{:>11} | {:<28} | {:>9.0} | {:>9.0} µs | {:>9.0} µs | {:>+13.1}% | {:>6.3}",
                concurrency,
                variants[i].name(),
                rate,
                p50.as_secs_f64() * 1e6,
                p99.as_secs_f64() * 1e6,
                (base / rate - 1.0) * 100.0,
                floor / rate
            );
        }
    }
}
