//! The parked and dead lists when every payload weighs a megabyte: the weight of a page (bytes
//! of HTML) and how long it takes to answer (median of `REPEAT` requests over loopback HTTP),
//! at the first page, a page at 90%, the dead list, an event page and its payload; the peak
//! memory of the process that serves them; and the first page in headless Chromium, to its
//! `load` event (`BROWSER=0` leaves it out).
//!
//! `MODE=payloads ROWS=10000 BYTES=1000000 REPEAT=11 cargo bench -p outbox-tests --bench
//! console`: `ROWS` parked rows and `ROWS / 10` dead rows, each with a payload of about `BYTES`
//! bytes of JSON that does not compress (hex digits), ten thousand of a megabyte being 10 GB.
//! `BENCH_DB=<name>` keeps the database (created and filled the first time, reused after), so
//! that the pages of two builds can be measured on the same rows, one after the other.

use std::time::Instant;

use outbox_runtime::console::ConsoleSettings;
use outbox_tests::bench::{env, median};
use outbox_tests::browser::Served;
use outbox_tests::{database_url, url_with_database, TestDb};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

/// A payload of about `bytes` bytes: the same hex digits for every row (each row stores its
/// own copy; they do not compress), made once per batch.
fn payload(bytes: i64) -> String {
    format!(
        "jsonb_build_object('seq', i, 'doc', (SELECT string_agg(md5(g::text), '') \
           FROM generate_series(1, {}) AS g))",
        (bytes / 32).max(1)
    )
}

/// Parked outbox rows and dead inbox rows up to `rows` and `rows / 10`, in batches of 200.
async fn fill(pool: &PgPool, rows: i64, bytes: i64) {
    let t = Instant::now();
    loop {
        let parked: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE parked_at IS NOT NULL")
                .fetch_one(pool)
                .await
                .unwrap();
        if parked >= rows {
            break;
        }
        let n = (rows - parked).min(200);
        sqlx::query(&format!(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, \
                                       payload, topic, partition_key, attempts, last_error, \
                                       parked_at) \
             SELECT gen_random_uuid(), 'Document', i::text, 'DocumentStored', {}, \
                    'docs.events', 'doc-' || i, 3, \
                    'Message production error: MessageSizeTooLarge (Broker: Message size too \
                     large)', now() \
             FROM generate_series($1::int8, $2::int8) AS i",
            payload(bytes)
        ))
        .bind(parked + 1)
        .bind(parked + n)
        .execute(pool)
        .await
        .unwrap();
        eprint!(
            "\rparked rows: {} of {rows} ({:.0} s)",
            parked + n,
            t.elapsed().as_secs_f64()
        );
    }
    let dead_rows = rows / 10;
    loop {
        let dead: i64 =
            sqlx::query_scalar("SELECT count(*) FROM inbox_event WHERE dead_at IS NOT NULL")
                .fetch_one(pool)
                .await
                .unwrap();
        if dead >= dead_rows {
            break;
        }
        let n = (dead_rows - dead).min(200);
        sqlx::query(&format!(
            "INSERT INTO inbox_event (event_id, payload, topic, event_type, attempts, \
                                      last_error, dead_at) \
             SELECT gen_random_uuid(), {}, 'docs.events', 'DocumentStored', 5, \
                    'handler failed', now() \
             FROM generate_series($1::int8, $2::int8) AS i",
            payload(bytes)
        ))
        .bind(dead + 1)
        .bind(dead + n)
        .execute(pool)
        .await
        .unwrap();
        eprint!(
            "\rdead rows: {} of {dead_rows} ({:.0} s)  ",
            dead + n,
            t.elapsed().as_secs_f64()
        );
    }
    eprintln!();
}

/// The database `name`, created and migrated if it does not exist; never dropped.
async fn kept(name: &str) -> PgPool {
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&database_url())
        .await
        .unwrap();
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(name)
            .fetch_one(&admin)
            .await
            .unwrap();
    if !exists {
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await
            .unwrap();
    }
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .connect(&url_with_database(&database_url(), name))
        .await
        .unwrap();
    if !exists {
        outbox_runtime::migrate(&pool).await.unwrap();
    }
    pool
}

/// The peak resident memory of this process so far, in MB (`VmHWM`).
fn peak_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

pub async fn run() {
    let rows: i64 = env("ROWS", 10_000);
    let bytes: i64 = env("BYTES", 1_000_000);
    let repeat: usize = env("REPEAT", 11);
    let (_db, pool) = match std::env::var("BENCH_DB") {
        Ok(name) => (None, kept(&name).await),
        Err(_) => {
            let db = TestDb::new().await;
            let pool = db.pool.clone();
            (Some(db), pool)
        }
    };
    fill(&pool, rows, bytes).await;
    let (deep, event): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT id FROM outbox_event WHERE parked_at IS NOT NULL ORDER BY id \
                 OFFSET (SELECT count(*) * 9 / 10 FROM outbox_event WHERE parked_at IS NOT NULL) \
                 LIMIT 1), \
                (SELECT min(id) FROM outbox_event)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let served = Served::start(
        &pool,
        ConsoleSettings::default().sample_interval(std::time::Duration::from_secs(3600)),
    )
    .await;
    // The health check behind the warnings, done once before the pages are measured.
    served.request("GET", "/", &[], "").await;
    println!(
        "\n{rows} parked rows and {} dead rows, payloads of {bytes} bytes; median of {repeat} \
         requests; peak memory of this process before the pages: {:.0} MB",
        rows / 10,
        peak_mb()
    );
    println!("| page | bytes | ms |");
    println!("|---|---:|---:|");
    for (name, path) in [
        ("parked, first page", "/parked".to_owned()),
        ("parked, page at 90%", format!("/parked?after={deep}")),
        ("dead, first page", "/dead".to_owned()),
        ("an event's page", format!("/event?id={event}")),
        (
            "its payload, whole",
            format!("/event/payload?id={event}&of=outbox"),
        ),
    ] {
        let mut samples = Vec::new();
        let mut size = 0;
        for _ in 0..repeat {
            let t = Instant::now();
            let (code, body) = served.request("GET", &path, &[], "").await;
            samples.push(t.elapsed().as_secs_f64() * 1000.0);
            size = body.split_once("\r\n\r\n").map_or(0, |(_, b)| b.len());
            if code != 200 {
                samples.clear();
                println!("| {name} | HTTP {code} | - |");
                break;
            }
        }
        if !samples.is_empty() {
            println!("| {name} | {size} | {:.1} |", median(samples));
        }
    }
    println!(
        "peak memory of this process after the pages: {:.0} MB",
        peak_mb()
    );
    if env("BROWSER", 1) == 1 {
        in_the_browser(&served, repeat).await;
    }
}

/// The parked list's first page in headless Chromium at 1400 px: from the request to the end
/// of its `load` event (the page parsed, laid out and its script run), as the browser's
/// navigation timing says, median of `repeat` loads.
async fn in_the_browser(served: &Served, repeat: usize) {
    let browser = outbox_tests::browser::Browser::start().await;
    let mut samples = Vec::new();
    let mut bytes = 0;
    for _ in 0..repeat {
        browser.client.goto(&served.url("/parked")).await.unwrap();
        let timing = browser
            .eval(
                "const n = performance.getEntriesByType('navigation')[0];
                 return [n.loadEventEnd - n.startTime, n.decodedBodySize];",
            )
            .await;
        samples.push(timing[0].as_f64().unwrap());
        bytes = timing[1].as_u64().unwrap();
    }
    println!(
        "in headless Chromium, the parked list's first page: {bytes} bytes, {:.0} ms to its \
         load event (median of {repeat})",
        median(samples)
    );
    browser.close().await;
}
