//! The console's pages on a small and a large installation, side by side in one run: how long
//! each page takes to answer (median of `REPEAT` requests over loopback HTTP), with the
//! statistics as the rows were written (never analyzed: autovacuum is off on these machines)
//! and after `ANALYZE`.
//!
//! `cargo bench -p outbox-tests --bench console` (ROWS=1000000 REPEAT=15). The pages share
//! one health check per sample interval (their warnings, the overview's figures): it is
//! measured on its own, and the pages with it done. The large
//! installation has `ROWS` parked outbox rows and `ROWS / 5` dead inbox rows, one topic in a
//! thousand rare; the small one a thousandth of that. Rows are as the relay and the consumers
//! leave them: a parked row without a retry time (until migration 18, it kept one); inbox rows
//! in batches of 500 sharing a `received_at` (a consumer's transaction).
//!
//! `MODE=payloads` measures the lists with large payloads instead (`payloads.rs`).

use std::time::Instant;

use outbox_runtime::console::ConsoleSettings;
use outbox_tests::bench::{env, median};
use outbox_tests::browser::Served;
use outbox_tests::TestDb;
use sqlx::PgPool;

#[path = "console/payloads.rs"]
mod payloads;

async fn fill(pool: &PgPool, rows: i64) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key, attempts, last_error, parked_at, \
                                   next_attempt_at) \
         SELECT gen_random_uuid(), 'Account', 'k-' || i, 'Deposited', \
                jsonb_build_object('seq', i, 'note', repeat('x', 100)), \
                CASE WHEN i % 1000 = 0 THEN 'rare.events' ELSE 'bench.events' END, \
                'k-' || (i % 5000), 3, 'Broker: Policy violation', now(), NULL \
         FROM generate_series(1, $1::int8) AS i",
    )
    .bind(rows)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO inbox_event (event_id, payload, topic, event_type, attempts, last_error, dead_at, \
                                  received_at) \
         SELECT gen_random_uuid(), jsonb_build_object('seq', i), \
                CASE WHEN i % 1000 = 0 THEN 'rare.events' ELSE 'bench.events' END, \
                'PaymentSucceeded', 5, 'handler failed', now(), \
                now() - interval '1 hour' + (i / 500) * interval '10 ms' \
         FROM generate_series(1, $1::int8 / 5) AS i",
    )
    .bind(rows)
    .execute(pool)
    .await
    .unwrap();
}

/// `rows` unpublished outbox rows, none refused yet: a broker outage's backlog.
async fn fill_backlog(pool: &PgPool, rows: i64) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key) \
         SELECT gen_random_uuid(), 'Account', 'k-' || i, 'Deposited', \
                jsonb_build_object('seq', i, 'note', repeat('x', 100)), 'bench.events', \
                'k-' || (i % 5000) \
         FROM generate_series(1, $1::int8) AS i",
    )
    .bind(rows)
    .execute(pool)
    .await
    .unwrap();
    // One poison row, so that every page has something to show.
    fill(pool, 1).await;
}

/// The paths measured, the deep page's cursor and a real event id filled in.
async fn paths(pool: &PgPool) -> Vec<(&'static str, String)> {
    let deep: i64 = sqlx::query_scalar(
        "SELECT coalesce((SELECT id FROM outbox_event WHERE parked_at IS NOT NULL ORDER BY id \
                          OFFSET (SELECT count(*) * 9 / 10 FROM outbox_event \
                                  WHERE parked_at IS NOT NULL) LIMIT 1), 0)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let event: uuid::Uuid =
        sqlx::query_scalar("SELECT event_id FROM outbox_event ORDER BY id DESC LIMIT 1")
            .fetch_one(pool)
            .await
            .unwrap();
    vec![
        ("overview", "/".to_owned()),
        ("parked, first page", "/parked".to_owned()),
        ("parked, page at 90%", format!("/parked?after={deep}")),
        ("parked, rare topic", "/parked?topic=rare.events".to_owned()),
        ("dead, first page", "/dead".to_owned()),
        ("dead, rare topic", "/dead?topic=rare.events".to_owned()),
        ("find an event", format!("/event?id={event}")),
        ("relays", "/relays".to_owned()),
    ]
}

/// The health check behind every page's warnings and the overview's figures: run once per
/// sample interval, whatever the number of pages read meanwhile.
async fn measure_health(pool: &PgPool, repeat: usize) -> f64 {
    let thresholds = outbox_runtime::admin::HealthThresholds::default();
    let mut samples = Vec::new();
    for _ in 0..repeat {
        let t = Instant::now();
        outbox_runtime::admin::health_estimated(pool, &thresholds)
            .await
            .unwrap();
        samples.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    median(samples)
}

async fn measure(served: &Served, path: &str, repeat: usize) -> f64 {
    let mut samples = Vec::new();
    for _ in 0..repeat {
        let t = Instant::now();
        let (code, body) = served.request("GET", path, &[], "").await;
        assert_eq!(code, 200, "{path}: {body}");
        samples.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    median(samples)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::var("MODE").as_deref() == Ok("payloads") {
        return payloads::run().await;
    }
    let rows: i64 = env("ROWS", 1_000_000);
    let repeat: usize = env("REPEAT", 15);
    let small = TestDb::new().await;
    let large = TestDb::new().await;
    let backlog = TestDb::new().await;
    let t = Instant::now();
    fill(&small.pool, rows / 1000).await;
    fill(&large.pool, rows).await;
    fill_backlog(&backlog.pool, rows).await;
    eprintln!("filled in {:.0} s", t.elapsed().as_secs_f64());
    let settings =
        || ConsoleSettings::default().sample_interval(std::time::Duration::from_secs(3600));
    let served_small = Served::start(&small.pool, settings()).await;
    let served_large = Served::start(&large.pool, settings()).await;
    let served_backlog = Served::start(&backlog.pool, settings()).await;
    let small_paths = paths(&small.pool).await;
    let large_paths = paths(&large.pool).await;
    let backlog_paths = paths(&backlog.pool).await;
    for analyzed in [false, true] {
        if analyzed {
            for db in [&small, &large, &backlog] {
                sqlx::query("ANALYZE outbox_event, inbox_event")
                    .execute(&db.pool)
                    .await
                    .unwrap();
            }
        }
        println!(
            "\n{}, median of {repeat} requests, ms: small ({} parked, {} dead), poison ({rows} \
             parked, {} dead), backlog ({rows} unpublished)",
            if analyzed {
                "after ANALYZE"
            } else {
                "never analyzed"
            },
            rows / 1000,
            rows / 5000,
            rows / 5,
        );
        println!("| page | small | poison | ratio | backlog | ratio |");
        println!("|---|---:|---:|---:|---:|---:|");
        let (h_small, h_large, h_backlog) = (
            measure_health(&small.pool, repeat).await,
            measure_health(&large.pool, repeat).await,
            measure_health(&backlog.pool, repeat).await,
        );
        println!(
            "| health check (once per sample interval) | {h_small:.1} | {h_large:.1} | {:.1}× | {h_backlog:.1} | {:.1}× |",
            h_large / h_small,
            h_backlog / h_small
        );
        for ((name, s), ((_, l), (_, b))) in small_paths
            .iter()
            .zip(large_paths.iter().zip(&backlog_paths))
        {
            // In turn, so that all three see the same machine.
            let ms_small = measure(&served_small, s, repeat).await;
            let ms_large = measure(&served_large, l, repeat).await;
            let ms_backlog = measure(&served_backlog, b, repeat).await;
            println!(
                "| {name} | {ms_small:.1} | {ms_large:.1} | {:.1}× | {ms_backlog:.1} | {:.1}× |",
                ms_large / ms_small,
                ms_backlog / ms_small
            );
        }
    }
}
