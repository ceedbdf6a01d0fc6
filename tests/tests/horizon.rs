//! Months of traffic start with minutes of it: under sustained, bursty emits no session the
//! framework holds (the relay's, its LISTEN connection, a dedup consumer's, an inbox receipt's
//! and processor's) may keep PostgreSQL's
//! cleanup horizon back, the NOTIFY queue must stay empty, and emitters need not notify. A session whose `backend_xmin`
//! lags keeps vacuum from removing every row version deleted since (published outbox rows,
//! the unpublished index's dead entries); a NOTIFY queue that fills refuses every notifying
//! commit, and so every emit, once full.
//!
//! It runs alone (`.ci/run`, after the parallel suite): the NOTIFY queue is the whole server's,
//! so another test's stalled listener (a black-holed connection) would show here, and its load
//! would slow the others.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_runtime::inbox::{Consumer, HandlerError, Mode};
use outbox_runtime::{inbox_handler, OutboxEvent};
use outbox_tests::kafka::Kafka;
use outbox_tests::{ChildGuard, Running, TestDb};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "meter.events";
const PARTITIONS: i32 = 6;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(topic = "meter.events", aggregate_type = "Meter", event_type = "Read")]
struct Read {
    #[outbox(aggregate_id)]
    meter: String,
    seq: u64,
}

#[inbox_handler]
async fn record_read(event: Read, tx: &mut PgConnection) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO meter_read (meter, seq) VALUES ($1, $2)")
        .bind(&event.meter)
        .bind(event.seq as i64)
        .execute(tx)
        .await?;
    Ok(())
}

/// One look at the server: the next transaction id, the NOTIFY queue, and of this database's
/// other sessions the one whose snapshot is oldest.
#[derive(Debug)]
struct Sample {
    at: Instant,
    next_xid: i64,
    /// `(age of backend_xmin in transactions, application_name, state, wait_event)`.
    oldest: Option<(i64, String, String, String)>,
    queue_usage: f64,
}

async fn sample(conn: &mut PgConnection, database: &str) -> Sample {
    let (next_xid, queue_usage): (i64, f64) = sqlx::query_as(
        "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8, \
                pg_notification_queue_usage()",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    let oldest: Option<(i64, String, String, String)> = sqlx::query_as(
        "SELECT age(backend_xmin)::int8, application_name, coalesce(state, ''), \
                coalesce(wait_event_type || ':' || wait_event, '') \
         FROM pg_stat_activity \
         WHERE datname = $1 AND pid <> pg_backend_pid() AND backend_xmin IS NOT NULL \
           AND backend_type = 'client backend' \
         ORDER BY age(backend_xmin) DESC LIMIT 1",
    )
    .bind(database)
    .fetch_optional(&mut *conn)
    .await
    .unwrap();
    Sample {
        at: Instant::now(),
        next_xid,
        oldest,
        queue_usage,
    }
}

/// Emits `per_tick` events every `tick` until `stop`, each in a transaction of its own that
/// calls `outbox_emit` (what `Uow::commit` sends, here in one round trip, so that one test
/// process commits as many as a fleet of request handlers); returns how many committed.
/// Several of these at once commit in bursts.
async fn emitter(
    pool: PgPool,
    id: usize,
    tick: Duration,
    per_tick: usize,
    stop: CancellationToken,
) -> u64 {
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    while !stop.is_cancelled() {
        interval.tick().await;
        for _ in 0..per_tick {
            let meter = format!("m-{}", (seq as usize * 7 + id) % 500);
            let payload = serde_json::json!({ "meter": meter, "seq": seq }).to_string();
            sqlx::query(
                "SELECT outbox_emit(ARRAY[$1::uuid], ARRAY['Meter'], ARRAY[$2], ARRAY['Read'], \
                                    ARRAY[$3], ARRAY['meter.events'], ARRAY[$2])",
            )
            .bind(uuid::Uuid::now_v7())
            .bind(&meter)
            .bind(payload)
            .execute(&pool)
            .await
            .unwrap();
            seq += 1;
        }
    }
    seq
}

/// A setting of this test from the environment: `HORIZON_SECS` (how long emitters run,
/// default 180: on the code before the fix, the relay's listener blocked after about 150 s
/// here), `HORIZON_BURST` (events each of the 8 emitters commits back to back at every tick,
/// default 8) and `HORIZON_RATE` (the emits per second the ticks aim at, default 2,500: more
/// than PostgreSQL commits with a NOTIFY each here, about 1,400/s, and a bound, so that a
/// faster machine does not leave the consumers minutes of backlog to drain).
fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sustained_emits_hold_neither_the_cleanup_horizon_nor_the_notify_queue() {
    let seconds = setting("HORIZON_SECS", 180);
    let burst = setting("HORIZON_BURST", 8) as usize;
    let rate = setting("HORIZON_RATE", 2_500).max(1);
    let tick = Duration::from_secs_f64(8.0 * burst as f64 / rate as f64);
    let db = TestDb::new().await;
    sqlx::query("CREATE TABLE meter_read (meter text NOT NULL, seq int8 NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    // The relay in a process of its own, as deployed.
    let _relay = ChildGuard(
        std::process::Command::new(env!("CARGO_BIN_EXE_outbox-test-relay"))
            .args([&db.url, &kafka.bootstrap(), "500"])
            .spawn()
            .expect("start relay process"),
    );
    // Two consumer groups, each handling every event once: one in dedup mode, one in inbox
    // mode (receipt and a processor).
    let consumers: Vec<_> = [("meters", Mode::Dedup), ("meters-inbox", Mode::Inbox)]
        .into_iter()
        .map(|(group, mode)| {
            Running::consumer(
                &Consumer::builder(db.pool.clone())
                    .brokers(kafka.bootstrap())
                    .group_id(group)
                    .mode(mode)
                    .handler(record_read)
                    .build()
                    .unwrap(),
            )
        })
        .collect();

    // Commits that do not wait for their WAL flush: more of them per second (and so more
    // notifications) than this machine's disk would allow otherwise.
    let emitters = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(
            db.url
                .parse::<sqlx::postgres::PgConnectOptions>()
                .unwrap()
                .options([("synchronous_commit", "off")]),
        )
        .await
        .unwrap();
    // How many commits notified (read all the time, as a listener must be).
    let notified = Arc::new(AtomicU64::new(0));
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener.listen("outbox_event").await.unwrap();
    let counter = {
        let notified = Arc::clone(&notified);
        tokio::spawn(async move {
            while listener.recv().await.is_ok() {
                notified.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let stop = CancellationToken::new();
    let tasks: Vec<_> = (0..8)
        .map(|id| tokio::spawn(emitter(emitters.clone(), id, tick, burst, stop.clone())))
        .collect();

    let mut watcher = sqlx::Connection::connect(&db.url).await.unwrap();
    // The samples of the last 10 s, and the latest one at least 10 s old.
    let mut window: VecDeque<Sample> = VecDeque::new();
    let started = Instant::now();
    let mut problem: Option<String> = None;
    let (mut worst_lag, mut worst_usage) = (0.0f64, 0.0f64);
    while problem.is_none() && started.elapsed() < Duration::from_secs(seconds) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let s = sample(&mut watcher, &db.name).await;
        while window.len() > 1 && s.at - window[1].at >= Duration::from_secs(10) {
            window.pop_front();
        }
        worst_usage = worst_usage.max(s.queue_usage);
        if s.queue_usage > 1e-4 {
            problem = Some(format!(
                "the NOTIFY queue is {:.4}% full",
                s.queue_usage * 100.0
            ));
        }
        if let (Some(first), Some((age, app, state, wait))) = (window.front(), &s.oldest) {
            if s.at - first.at >= Duration::from_secs(10) {
                // A session may be as far behind as the last 10 s of transactions, no further.
                let allowed = s.next_xid - first.next_xid;
                let lag = *age as f64 / allowed.max(1) as f64 * 10.0;
                worst_lag = worst_lag.max(lag);
                if *age > allowed {
                    problem = Some(format!(
                        "a session ({app:?}, {state}, {wait}) holds a snapshot {age} \
                         transactions old, more than the last 10 s of transactions ({allowed})"
                    ));
                }
            }
        }
        window.push_back(s);
    }
    let elapsed = started.elapsed();
    stop.cancel();
    let mut emitted = 0;
    for t in tasks {
        emitted += t.await.unwrap();
    }
    counter.abort();
    let achieved = emitted as f64 / elapsed.as_secs_f64();
    if let Some(problem) = problem {
        panic!("after {elapsed:?} of {achieved:.0} emits/s: {problem}");
    }
    // Under sustained traffic no relay waits for a notification, so commits need not send one
    // (a notifying commit takes a database-wide lock, serializing emitters).
    let notified = notified.load(Ordering::Relaxed);
    assert!(
        notified * 2 < emitted,
        "{notified} of {emitted} commits notified under sustained traffic"
    );
    println!(
        "{emitted} events in {elapsed:?} ({achieved:.0}/s): the oldest snapshot at most {worst_lag:.1} s \
         of transactions behind, the NOTIFY queue at most {:.5}% full; {:.1}% of the commits \
         notified",
        worst_usage * 100.0,
        notified as f64 / emitted.max(1) as f64 * 100.0
    );
    // Everything arrives, once in each group.
    let handled = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM meter_read")
            .fetch_one(&db.pool)
            .await
            .unwrap() as u64
    };
    // The consumers drain what they had left at their own pace; they fail only when they stop
    // making progress.
    let mut last = (handled().await, Instant::now());
    let drain_started = Instant::now();
    while last.0 < 2 * emitted {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = handled().await;
        if now > last.0 {
            last = (now, Instant::now());
        }
        assert!(
            last.1.elapsed() < Duration::from_secs(60),
            "the consumers handled {} of {} events, and none more for 60 s",
            last.0,
            2 * emitted
        );
    }
    println!(
        "the consumers drained the rest in {:?}",
        drain_started.elapsed()
    );
    Running::stop_all(consumers).await;
    assert_eq!(
        handled().await,
        2 * emitted,
        "each event handled once by each group"
    );
}
