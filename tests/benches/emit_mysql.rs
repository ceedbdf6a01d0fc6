//! What an emit adds to a command transaction on MariaDB (issue 38), against the floor: the same
//! outbox row written by a hand-written, parameterized `INSERT` in a plain sqlx transaction (no
//! probe, no key lock, no unit of work).
//!
//! On one fresh database, transactions of one domain `INSERT` alone, with the hand-written
//! outbox `INSERT`, with one `emit`, and with `emit_all` of 10 events, at concurrency 1 and 8.
//! The variants are interleaved round by round so that the machine's noise hits them alike;
//! the figures are medians over rounds, and each ratio is the median of the per-round ratios.
//!
//! `cargo bench -p outbox-tests --bench emit_mysql` (env: `ROUNDS`, default 7; `TXS`,
//! transactions per task per round, default 300; `MYSQL_URL`).

use std::time::Duration;

use outbox_runtime::{OutboxRecord, Uow};
use outbox_tests::bench::{concurrent_calls, env, median, percentile};
use outbox_tests::fixtures::OrderCreated;
use outbox_tests::mysql::MySqlTestDb;
use sqlx::MySqlPool;
use uuid::Uuid;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    NoEmit,
    HandInsert,
    Emit1,
    EmitAll10,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::NoEmit => "insert only",
            Variant::HandInsert => "insert + hand-written INSERT",
            Variant::Emit1 => "insert + emit",
            Variant::EmitAll10 => "insert + emit_all(10)",
        }
    }
}

fn order() -> OrderCreated {
    OrderCreated {
        order_id: Uuid::now_v7(),
        customer_id: Uuid::now_v7(),
        amount: 100,
    }
}

async fn command(pool: &MySqlPool, variant: Variant) {
    let order = order();
    let mut uow = Uow::begin(pool).await.unwrap();
    sqlx::query("INSERT INTO orders (id, customer_id, amount) VALUES (?, ?, ?)")
        .bind(order.order_id)
        .bind(order.customer_id)
        .bind(order.amount)
        .execute(uow.tx())
        .await
        .unwrap();
    match variant {
        Variant::NoEmit => {}
        Variant::HandInsert => {
            let record = OutboxRecord::from_event(&order).unwrap();
            sqlx::query(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, \
                 payload, topic, partition_key, key_bucket, created_at) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, CRC32(?) & 65535, UTC_TIMESTAMP(6))",
            )
            .bind(record.event_id())
            .bind(record.aggregate_type())
            .bind(record.aggregate_id())
            .bind(record.event_type())
            .bind(record.payload())
            .bind(record.topic())
            .bind(record.partition_key())
            .bind(record.partition_key())
            .execute(uow.tx())
            .await
            .unwrap();
            // A plain commit: the floor has no check of its transaction.
            return uow.into_inner().await.unwrap().commit().await.unwrap();
        }
        Variant::Emit1 => {
            uow.emit(&order).await.unwrap();
        }
        Variant::EmitAll10 => {
            let lines: Vec<OrderCreated> = (0..10)
                .map(|i| OrderCreated {
                    amount: i,
                    ..order.clone()
                })
                .collect();
            uow.emit_all(&lines).await.unwrap();
        }
    }
    uow.commit().await.unwrap();
}

/// `txs` transactions in each of `concurrency` tasks: (tx/s, latencies).
async fn round(
    pool: &MySqlPool,
    variant: Variant,
    concurrency: usize,
    txs: usize,
) -> (f64, Vec<Duration>) {
    let pool = pool.clone();
    concurrent_calls(concurrency, txs, move || {
        let pool = pool.clone();
        async move { command(&pool, variant).await }
    })
    .await
}

#[tokio::main]
async fn main() {
    let rounds: usize = env("ROUNDS", 7);
    let txs: usize = env("TXS", 300);
    let db = MySqlTestDb::new().await;
    sqlx::query(
        "CREATE TABLE orders (id BINARY(16) PRIMARY KEY, customer_id BINARY(16) NOT NULL, \
         amount BIGINT NOT NULL) ENGINE = InnoDB",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (version, flush): (String, u64) =
        sqlx::query_as("SELECT VERSION(), @@innodb_flush_log_at_trx_commit")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let variants = [
        Variant::NoEmit,
        Variant::HandInsert,
        Variant::Emit1,
        Variant::EmitAll10,
    ];
    println!(
        "emit on {version} (innodb_flush_log_at_trx_commit={flush}): {rounds} rounds x {txs} \
         transactions per task, medians over rounds"
    );
    println!(
        "{:>11} | {:<28} | {:>9} | {:>12} | {:>12} | {:>7}",
        "concurrency", "transaction", "tx/s", "p50 latency", "p99 latency", "x floor"
    );
    for concurrency in [1, 8] {
        for v in variants {
            round(&db.pool, v, concurrency, 20).await;
        }
        let mut rates = vec![Vec::new(); variants.len()];
        let mut ratios = vec![Vec::new(); variants.len()];
        let mut latencies = vec![Vec::new(); variants.len()];
        for r in 0..rounds {
            let mut this_round = vec![0.0; variants.len()];
            // Rotate the order each round: no variant always runs first.
            for k in 0..variants.len() {
                let i = (k + r) % variants.len();
                let (rate, lat) = round(&db.pool, variants[i], concurrency, txs).await;
                this_round[i] = rate;
                latencies[i].extend(lat);
            }
            let floor = this_round[1];
            for i in 0..variants.len() {
                rates[i].push(this_round[i]);
                // Time per transaction over the floor's.
                ratios[i].push(floor / this_round[i]);
            }
        }
        for (i, v) in variants.iter().enumerate() {
            println!(
                "{:>11} | {:<28} | {:>9.0} | {:>9.0} µs | {:>9.0} µs | {:>7.2}",
                concurrency,
                v.name(),
                median(rates[i].clone()),
                percentile(&mut latencies[i], 0.50).as_secs_f64() * 1e6,
                percentile(&mut latencies[i], 0.99).as_secs_f64() * 1e6,
                median(ratios[i].clone()),
            );
        }
    }
}
