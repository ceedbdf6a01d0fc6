//! Inbox processing alone: how fast processors drain `inbox_event` rows, by number of
//! processors and of partition keys, with a handler that does nothing (the framework's cost).
//! The rows are inserted as a receipt would store them, in one transaction; no broker is
//! involved. The processors run as a consumer runs them (`run_processor`, polling every
//! millisecond), started before the first round and kept through the rounds, so what is timed
//! is from the rows' commit to the last one processed. `STALE=1` leaves the statistics as
//! the emptied table's (a new partition before its first analyze).
//!
//! `cargo bench -p outbox-tests --bench inbox_processing` (env: `N`, default 20000; `ROUNDS`,
//! default 3; `PROCESSORS`, default `1,2,4`; `KEYS`, default `0,1000,100,10`, 0 meaning a key
//! per row). Run it at two commits in turn to compare them: it uses only what both have.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use outbox_runtime::inbox::{Consumer, Mode};
use outbox_tests::bench::{env, median, rate, PaymentSucceeded};
use outbox_tests::TestDb;
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const TOPIC: &str = "bench.payments";

/// The handler's calls since the round's rows were written.
static HANDLED: AtomicUsize = AtomicUsize::new(0);

/// Does nothing but count its calls (the framework's cost alone).
#[outbox_runtime::inbox_handler]
async fn counted(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    let _ = (event, tx);
    HANDLED.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// `n` unprocessed rows, keyed by `keys` keys in turn (0: a key per row).
async fn fill(pool: &PgPool, n: usize, keys: usize) {
    sqlx::query("VACUUM ANALYZE inbox_event")
        .execute(pool)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("TRUNCATE inbox_event")
        .execute(&mut *tx)
        .await
        .unwrap();
    let key_ids: Vec<Uuid> = (0..keys.max(1)).map(|_| Uuid::now_v7()).collect();
    let mut ids = Vec::with_capacity(n);
    let mut payloads = Vec::with_capacity(n);
    let mut partition_keys = Vec::with_capacity(n);
    for i in 0..n {
        let payment_id = if keys == 0 {
            Uuid::now_v7()
        } else {
            key_ids[i % keys]
        };
        let event = PaymentSucceeded {
            payment_id,
            order_id: Uuid::now_v7(),
            amount: 100,
        };
        ids.push(Uuid::now_v7());
        payloads.push(serde_json::to_string(&event).unwrap());
        partition_keys.push(payment_id.to_string());
    }
    for ((ids, payloads), partition_keys) in ids
        .chunks(5_000)
        .zip(payloads.chunks(5_000))
        .zip(partition_keys.chunks(5_000))
    {
        sqlx::query(
            "INSERT INTO inbox_event (event_id, topic, event_type, partition_key, payload, \
                 source_partition, source_offset) \
             SELECT id, $4, 'PaymentSucceeded', k, p::jsonb, 0, n \
             FROM unnest($1::uuid[], $2::text[], $3::text[]) WITH ORDINALITY AS r(id, p, k, n) \
             ORDER BY n",
        )
        .bind(ids)
        .bind(payloads)
        .bind(partition_keys)
        .bind(TOPIC)
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    // In the transaction, so the statistics count the rows (unless `STALE` is set: what the
    // planner knows is the empty table).
    if std::env::var_os("STALE").is_none() {
        sqlx::query("ANALYZE inbox_event")
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
}

async fn unprocessed(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM inbox_event WHERE NOT processed")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// `processors` processors, running until cancelled.
fn start(consumer: &Consumer, processors: usize) -> (CancellationToken, Vec<JoinHandle<()>>) {
    let cancel = CancellationToken::new();
    let tasks = (0..processors)
        .map(|_| {
            let (consumer, cancel) = (consumer.clone(), cancel.clone());
            tokio::spawn(async move { consumer.run_processor(cancel).await.unwrap() })
        })
        .collect();
    (cancel, tasks)
}

/// Events/s of the running processors from the rows' commit to the last one processed.
async fn drain(pool: &PgPool, n: usize, keys: usize) -> f64 {
    HANDLED.store(0, Ordering::Relaxed);
    fill(pool, n, keys).await;
    let start = Instant::now();
    while HANDLED.load(Ordering::Relaxed) < n {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    while unprocessed(pool).await > 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    rate(n as u64, start.elapsed())
}

fn list(name: &str, default: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .map(|s| s.trim().parse().expect("a list of numbers"))
        .collect()
}

#[tokio::main]
async fn main() {
    let n: usize = env("N", 20_000);
    let rounds: usize = env("ROUNDS", 3);
    let processors = list("PROCESSORS", "1,2,4");
    let keys = list("KEYS", "0,1000,100,10");
    let db = TestDb::new().await;
    // Never connected: the processors only use the database.
    let consumer = Consumer::builder(db.pool.clone())
        .brokers("127.0.0.1:9")
        .group_id("bench")
        .handler(counted)
        .mode(Mode::Inbox)
        .processors(0)
        .poll_interval(Duration::from_millis(1))
        .build()
        .unwrap();
    println!("inbox processing, {n} rows, medians of {rounds} rounds (events/s):");
    println!("{:>6} {:>10} {:>10}", "keys", "processors", "events/s");
    for &k in &keys {
        for &p in &processors {
            let (cancel, tasks) = start(&consumer, p);
            let mut samples = Vec::with_capacity(rounds);
            for _ in 0..rounds {
                samples.push(drain(&db.pool, n, k).await);
            }
            cancel.cancel();
            for task in tasks {
                task.await.unwrap();
            }
            let key_label = if k == 0 {
                "each".to_owned()
            } else {
                k.to_string()
            };
            println!("{key_label:>6} {p:>10} {:>10.0}", median(samples));
        }
    }
}
