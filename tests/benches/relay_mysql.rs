//! The relay on MariaDB (issue 38): how fast it drains a backlog against the database's own
//! share of the work, at two backlog sizes, and how long a committed event waits before it is
//! published when the relay is woken in process and when it finds the event by polling; and
//! what an idle relay costs the server.
//!
//! - **Drain**: a backlog of `BACKLOG` (and ten times as many) rows over 100 keys; each round
//!   marks every row unpublished again and drains it twice, interleaved: the relay publishing to
//!   the mock Kafka cluster, and the same relay doing only the database's work (claim, mark,
//!   commit; every row counted acknowledged). Medians over rounds; the ratio is the median of the
//!   per-round ratios.
//! - **Latency**: a running relay (default settings: poll interval 500 ms) and one event
//!   committed every 10 ms for `SECONDS`, by a unit of work (which wakes the relays of its
//!   process) and then by `mysql::emit` in a transaction the application commits itself (which
//!   cannot: the relay finds it by polling, as it finds another process's events). The latency
//!   is `published_at - created_at`, both the server's clock.
//! - **Idle**: `Com_select` (and `Com_stmt_execute`) of the server over 10 s with one idle
//!   relay and none.
//!
//! `cargo bench -p outbox-tests --bench relay_mysql` (env: `ROUNDS`, default 5; `BACKLOG`,
//! default 20,000; `SECONDS`, default 5; `MYSQL_URL`).

use std::time::{Duration, Instant};

use outbox_runtime::relay::Relay;
use outbox_runtime::Uow;
use outbox_tests::bench::{env, median, percentile, rate};
use outbox_tests::deposits::{deposit, Deposited, TOPIC};
use outbox_tests::kafka::Kafka;
use outbox_tests::mysql::{count, MySqlTestDb};
use sqlx::MySqlPool;
use tokio_util::sync::CancellationToken;

async fn fill(pool: &MySqlPool, n: usize) {
    let events: Vec<Deposited> = (0..n).map(|i| deposit(i % 100, i as u64)).collect();
    for chunk in events.chunks(1_000) {
        let mut uow = Uow::begin(pool).await.unwrap();
        uow.emit_all(chunk).await.unwrap();
        uow.commit().await.unwrap();
    }
}

async fn unpublish(pool: &MySqlPool) {
    sqlx::query("UPDATE outbox_event SET published_at = NULL")
        .execute(pool)
        .await
        .unwrap();
}

async fn drain(db: &MySqlTestDb, kafka: &Kafka, backlog: usize, rounds: usize) {
    fill(&db.pool, backlog).await;
    let relay = Relay::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .batch_size(500)
        .build()
        .unwrap();
    let (mut relayed, mut database, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        unpublish(&db.pool).await;
        let started = Instant::now();
        let n = outbox_runtime::relay::drain_mysql_without_broker(db.pool.clone(), 500)
            .await
            .unwrap();
        let alone = rate(n, started.elapsed());
        assert_eq!(n as usize, backlog);
        unpublish(&db.pool).await;
        let started = Instant::now();
        let n = relay.publish_pending().await.unwrap();
        let with = rate(n, started.elapsed());
        assert_eq!(n as usize, backlog);
        relayed.push(with);
        database.push(alone);
        ratios.push(with / alone);
    }
    println!(
        "| drain {backlog} rows (100 keys), batch 500 | {:.0}/s | {:.0}/s | {:.2} |",
        median(relayed),
        median(database),
        median(ratios)
    );
}

/// The bad case of a relay without a cursor: 500 keys held (a record of each waits for a retry
/// an hour away) with 20 rows behind each, which every claim walks past, while `backlog` rows of
/// other keys drain (the database's work alone).
async fn held_keys(kafka: &Kafka, backlog: usize, rounds: usize) {
    let db = MySqlTestDb::new().await;
    let held: Vec<Deposited> = (0..21)
        .flat_map(|seq| (0..500).map(move |k| deposit(1_000 + k, seq)))
        .collect();
    for chunk in held.chunks(1_000) {
        let mut uow = Uow::begin(&db.pool).await.unwrap();
        uow.emit_all(chunk).await.unwrap();
        uow.commit().await.unwrap();
    }
    fill(&db.pool, backlog).await;
    let hold = "UPDATE outbox_event o JOIN (SELECT MIN(id) AS id FROM outbox_event \
                WHERE CAST(partition_key AS CHAR) LIKE 'acct-1___' GROUP BY partition_key) h \
                ON o.id = h.id SET o.next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, \
                o.attempts = 1";
    let _ = kafka;
    let mut rates = Vec::new();
    for _ in 0..rounds {
        unpublish(&db.pool).await;
        sqlx::query(hold).execute(&db.pool).await.unwrap();
        let started = Instant::now();
        let n = outbox_runtime::relay::drain_mysql_without_broker(db.pool.clone(), 500)
            .await
            .unwrap();
        assert_eq!(n as usize, backlog);
        rates.push(rate(n, started.elapsed()));
    }
    println!(
        "| drain {backlog} rows past 500 held keys with 20 rows behind each (database's work) \
         | | {:.0}/s | |",
        median(rates)
    );
}

/// Commits one event every 10 ms for `seconds`, woken (a unit of work) or not (`mysql::emit`
/// in the application's transaction); returns the latencies.
async fn latency(pool: &MySqlPool, seconds: u64, woken: bool) -> Vec<Duration> {
    sqlx::query("DELETE FROM outbox_event")
        .execute(pool)
        .await
        .unwrap();
    let until = Instant::now() + Duration::from_secs(seconds);
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut i = 0u64;
    while Instant::now() < until {
        tick.tick().await;
        let event = deposit((i % 100) as usize, i);
        if woken {
            let mut uow = Uow::begin(pool).await.unwrap();
            uow.emit(&event).await.unwrap();
            uow.commit().await.unwrap();
        } else {
            let mut tx = pool.begin().await.unwrap();
            outbox_runtime::mysql::emit(&mut tx, &event).await.unwrap();
            tx.commit().await.unwrap();
        }
        i += 1;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while count(
        pool,
        "SELECT COUNT(*) FROM outbox_event WHERE published_at IS NULL",
    )
    .await
        > 0
    {
        assert!(Instant::now() < deadline, "not drained");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let micros: Vec<i64> = sqlx::query_scalar(
        "SELECT TIMESTAMPDIFF(MICROSECOND, created_at, published_at) FROM outbox_event",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    micros
        .into_iter()
        .map(|m| Duration::from_micros(m.max(0) as u64))
        .collect()
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// The server's `Com_select` and `Com_stmt_execute` counters.
async fn statements(pool: &MySqlPool) -> (i64, i64) {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT CAST(VARIABLE_NAME AS CHAR), CAST(VARIABLE_VALUE AS CHAR) \
         FROM information_schema.GLOBAL_STATUS \
         WHERE VARIABLE_NAME IN ('COM_SELECT', 'COM_STMT_EXECUTE')",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let get = |name: &str| {
        rows.iter()
            .find(|r| r.0.eq_ignore_ascii_case(name))
            .map_or(0, |r| r.1.parse().unwrap_or(0))
    };
    (get("COM_SELECT"), get("COM_STMT_EXECUTE"))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds: usize = env("ROUNDS", 5);
    let backlog: usize = env("BACKLOG", 20_000);
    let seconds: u64 = env("SECONDS", 5);
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 6).await;
    let version: String = {
        let db = MySqlTestDb::new().await;
        sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    println!("MariaDB relay ({version}), {rounds} rounds");
    println!("| case | relay to the mock cluster | database's work alone | ratio |");
    println!("|---|---|---|---|");
    for n in [backlog, backlog * 10] {
        let db = MySqlTestDb::new().await;
        drain(&db, &kafka, n, rounds).await;
    }
    held_keys(&kafka, backlog, rounds).await;

    let db = MySqlTestDb::new().await;
    let relay = Relay::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .build()
        .unwrap();
    let cancel = CancellationToken::new();
    let running = relay.spawn(cancel.clone());
    println!();
    println!("| commit to published, 100 events/s for {seconds} s | p50 | p90 | p99 | max |");
    println!("|---|---|---|---|---|");
    for woken in [true, false] {
        let mut l = latency(&db.pool, seconds, woken).await;
        let name = if woken {
            "unit of work (wakes the relay in process)"
        } else {
            "mysql::emit, committed by the application (polling, poll interval 500 ms)"
        };
        println!(
            "| {name} | {} | {} | {} | {} |",
            ms(percentile(&mut l, 0.5)),
            ms(percentile(&mut l, 0.9)),
            ms(percentile(&mut l, 0.99)),
            ms(percentile(&mut l, 1.0))
        );
    }
    // Idle: let the relay's polling reach its interval, then count 10 s of statements, with
    // it and without.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = statements(&db.pool).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let with = statements(&db.pool).await;
    cancel.cancel();
    running.await.unwrap().unwrap();
    let without_before = statements(&db.pool).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let without = statements(&db.pool).await;
    let per_s =
        |a: (i64, i64), b: (i64, i64)| ((b.0 - a.0) as f64 / 10.0, (b.1 - a.1) as f64 / 10.0);
    let (idle_select, idle_exec) = per_s(before, with);
    let (base_select, base_exec) = per_s(without_before, without);
    println!();
    println!(
        "idle, server-wide per second: with one relay {idle_select:.1} SELECT + {idle_exec:.1} \
         prepared executions; with none {base_select:.1} + {base_exec:.1} (the counters' own \
         reads included)"
    );
}
