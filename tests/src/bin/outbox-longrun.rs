//! The long run (months without babysitting, compressed): emitters commit events at a fixed
//! rate, a relay publishes them to the mock Kafka cluster while running retention beside it (a
//! short window, so that rows and partitions come and go during the run), and a dedup consumer
//! applies each event: a row appended to an effects table (append-only, as an application's
//! ledger is; an in-place counter would measure its own update chains when the horizon is held). Every 10 s one CSV line: emit→handle latency
//! (p50, p99), the outbox tables' sizes and dead tuples (partitions summed), the backlog, the
//! oldest snapshot, and the health warnings standing. At the end it drains, checks every
//! account's effects against what was committed (0 lost, effects once), and prints a summary:
//! p99 per 5-minute window, sizes at 20 minutes and at the end, when each warning first showed.
//!
//! ```text
//! cargo run --release -p outbox-tests --bin outbox-longrun -- --minutes 60 --autovacuum on \
//!     --out docs/bench/longrun-autovacuum-on.csv
//! ```
//!
//! Options: `--minutes N` (60), `--rate EVENTS_PER_S` (1000), `--per-tx N` (5 events per
//! transaction), `--autovacuum on|off|keep` (`ALTER SYSTEM`, put back at the end), `--dedup
//! partitioned|plain` (a new installation's `processed_event`, or one from before partitions),
//! `--outbox partitioned|plain` (a new installation's outbox, or one from before partitions),
//! `--width-minutes N` (5: the partitions' width), `--retention-minutes N` (10: the
//! outbox's and the dedup window), `--hold-at S --hold-secs S` (a session idle in a
//! transaction, holding the cleanup horizon, from S seconds in), `--out FILE`.
//! It sets server-wide settings: run it alone.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use outbox_runtime::admin::{self, CleanupTable, HealthThresholds, Retention};
use outbox_runtime::inbox::{Consumer, HandlerError};
use outbox_runtime::relay::Relay;
use outbox_runtime::{inbox_handler, OutboxEvent, Uow};
use outbox_tests::kafka::Kafka;
use outbox_tests::{fixtures, HeldTransaction, TestDb};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "longrun.ticks";
const PARTITIONS: i32 = 12;
const ACCOUNTS: usize = 1000;
const SAMPLE: Duration = Duration::from_secs(10);
const WINDOW_SECS: u64 = 300;

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(
    topic = "longrun.ticks",
    aggregate_type = "Account",
    event_type = "Ticked"
)]
struct Ticked {
    #[outbox(aggregate_id)]
    account: String,
    /// When it was emitted, in microseconds since the Unix epoch.
    emitted_us: i64,
    note: String,
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// What the consumer saw: emit→handle latencies (ms) since the last sample, and how many
/// times its handler ran (rolled-back runs too: the effects table has the truth).
#[derive(Default)]
struct Seen {
    latencies: Mutex<Vec<u32>>,
    runs: std::sync::atomic::AtomicI64,
}

#[inbox_handler]
async fn tally(event: Ticked, tx: &mut PgConnection, seen: &Arc<Seen>) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO longrun_effect (account, emitted_us) VALUES ($1, $2)")
        .bind(&event.account)
        .bind(event.emitted_us)
        .execute(tx)
        .await?;
    seen.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let ms = (now_us() - event.emitted_us).max(0) / 1000;
    seen.latencies.lock().unwrap().push(ms as u32);
    Ok(())
}

struct Options {
    minutes: u64,
    rate: u64,
    per_tx: u64,
    autovacuum: String,
    dedup: String,
    outbox: String,
    width_minutes: u64,
    retention_minutes: u64,
    hold_at: Option<u64>,
    hold_secs: u64,
    out: String,
}

fn options() -> Options {
    let mut o = Options {
        minutes: 60,
        rate: 1000,
        per_tx: 5,
        autovacuum: "on".into(),
        dedup: "partitioned".into(),
        outbox: "partitioned".into(),
        width_minutes: 5,
        retention_minutes: 10,
        hold_at: None,
        hold_secs: 600,
        out: "/tmp/outbox-longrun.csv".into(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().unwrap_or_default();
        let number = || value.parse::<u64>().unwrap_or_else(|_| usage(&arg));
        match arg.as_str() {
            "--minutes" => o.minutes = number(),
            "--rate" => o.rate = number(),
            "--per-tx" => o.per_tx = number().max(1),
            "--autovacuum" if ["on", "off", "keep"].contains(&value.as_str()) => {
                o.autovacuum = value
            }
            "--dedup" if ["partitioned", "plain"].contains(&value.as_str()) => o.dedup = value,
            "--outbox" if ["partitioned", "plain"].contains(&value.as_str()) => o.outbox = value,
            "--width-minutes" => o.width_minutes = number().max(1),
            "--retention-minutes" => o.retention_minutes = number().max(1),
            "--hold-at" => o.hold_at = Some(number()),
            "--hold-secs" => o.hold_secs = number(),
            "--out" => o.out = value,
            _ => usage(&arg),
        }
    }
    o
}

fn usage(arg: &str) -> ! {
    eprintln!(
        "outbox-longrun: bad option {arg:?}; see the file's docs for --minutes, --rate, --per-tx, \
         --autovacuum on|off|keep, --dedup partitioned|plain, --outbox partitioned|plain, \
         --width-minutes, \
         --retention-minutes, --hold-at, --hold-secs, --out"
    );
    std::process::exit(2);
}

/// Puts the server's `autovacuum` back when dropped, also when the run panics (by `psql`: a
/// drop cannot wait for an async connection).
struct AutovacuumReset {
    url: String,
}

impl Drop for AutovacuumReset {
    fn drop(&mut self) {
        let reset = std::process::Command::new("psql")
            .args([
                self.url.as_str(),
                "-qc",
                "ALTER SYSTEM RESET autovacuum",
                "-c",
                "SELECT pg_reload_conf()",
            ])
            .stdout(std::process::Stdio::null())
            .status();
        if !reset.is_ok_and(|s| s.success()) {
            eprintln!(
                "outbox-longrun: could not reset autovacuum: run ALTER SYSTEM RESET autovacuum"
            );
        }
    }
}

/// Sets `autovacuum` server-wide (and reloads).
async fn set_autovacuum(pool: &PgPool, value: &str) {
    sqlx::query(&format!("ALTER SYSTEM SET autovacuum = {value}"))
        .execute(pool)
        .await
        .expect("ALTER SYSTEM");
    sqlx::query("SELECT pg_reload_conf()")
        .execute(pool)
        .await
        .unwrap();
    // A session reads the reloaded file when it next goes idle: wait until a new one reports
    // the setting, so that the run's header says what the server runs with.
    for _ in 0..100 {
        let mut conn = pool.acquire().await.unwrap().detach();
        let now: String = sqlx::query_scalar("SHOW autovacuum")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        if now == value {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("autovacuum is not {value} 10 s after the reload");
}

/// How many effects each account got.
async fn effects_by_account(pool: &PgPool) -> HashMap<String, u64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT account, count(*) FROM longrun_effect GROUP BY account")
            .fetch_all(pool)
            .await
            .unwrap();
    rows.into_iter().map(|(a, n)| (a, n as u64)).collect()
}

/// Sizes of `table` and its partitions: total bytes, dead tuples, partitions.
const TABLE_SQL: &str = "
SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::int8,
       coalesce(sum(s.n_dead_tup), 0)::int8,
       (count(*) - 1)::int8
FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = $1::regclass
   OR c.oid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = $1::regclass)";

struct Sample {
    t: u64,
    emitted: u64,
    handled: i64,
    p50: u32,
    p99: u32,
    tables: [(i64, i64, i64); 3],
    unpublished: i64,
    oldest_unpublished_ms: i64,
    oldest_snapshot_xids: i64,
    warnings: String,
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

#[tokio::main]
async fn main() {
    let o = options();
    // A new installation's tables are partitioned; one from before has plain tables, which
    // are converted where partitions are asked for.
    let db = if o.dedup == "plain" || o.outbox == "plain" {
        TestDb::before_partitions().await
    } else {
        TestDb::new().await
    };
    let admin_pool = db.pool(4).await;
    // Narrow partitions from now on (a new installation's are a day wide).
    let width = Duration::from_secs(o.width_minutes * 60);
    for (asked, table) in [
        (&o.dedup, CleanupTable::ProcessedEvent),
        (&o.outbox, CleanupTable::Outbox),
    ] {
        if asked == "partitioned" {
            admin::convert_to_partitions(&admin_pool, table)
                .await
                .expect("converting to partitions");
            fixtures::narrow_partitions(&admin_pool, table, width, "now()").await;
        }
    }
    sqlx::raw_sql("CREATE TABLE longrun_effect (account text NOT NULL, emitted_us int8 NOT NULL)")
        .execute(&admin_pool)
        .await
        .unwrap();
    let _reset = (o.autovacuum != "keep").then(|| AutovacuumReset {
        url: db.url.clone(),
    });
    if o.autovacuum != "keep" {
        set_autovacuum(&admin_pool, &o.autovacuum).await;
    }
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(&admin_pool)
        .await
        .unwrap();

    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    kafka
        .create_topic(&format!("{TOPIC}.retry"), PARTITIONS)
        .await;
    kafka.create_topic(&format!("{TOPIC}.dlq"), 1).await;
    let cancel = CancellationToken::new();
    let retention_window = Duration::from_secs(o.retention_minutes * 60);
    let relay = Relay::builder(db.pool(8).await)
        .brokers(kafka.bootstrap())
        .retention(
            Retention::new(retention_window)
                .dedup_older_than(retention_window)
                .every(Duration::from_secs(60)),
        )
        .build()
        .expect("relay");
    let relay_task = relay.spawn(cancel.clone());
    let seen = Arc::new(Seen::default());
    let consumer = Consumer::builder(db.pool(4).await)
        .brokers(kafka.bootstrap())
        .group_id("longrun")
        .state(Arc::clone(&seen))
        .handler(tally)
        .build()
        .expect("consumer");
    let consumer_task = consumer.spawn(cancel.clone());

    // Emitters: `per_tx` events per transaction, 4 tasks, a fixed schedule (missed ticks
    // catch up, so the rate holds on average).
    let committed: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let unknown: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let stop_emitting = CancellationToken::new();
    let emit_pool = db.pool(8).await;
    let tasks = 4u64;
    let period = Duration::from_secs_f64((tasks * o.per_tx) as f64 / o.rate as f64);
    let mut emitters = Vec::new();
    for task in 0..tasks {
        let (pool, stop) = (emit_pool.clone(), stop_emitting.clone());
        let (committed, unknown) = (committed.clone(), unknown.clone());
        let per_tx = o.per_tx;
        emitters.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut n = task;
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let mut uow = Uow::begin(&pool).await.expect("begin");
                let mut accounts = Vec::new();
                for _ in 0..per_tx {
                    n = n
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    let account = format!("acct-{}", (n >> 33) % ACCOUNTS as u64);
                    let event = Ticked {
                        account: account.clone(),
                        emitted_us: now_us(),
                        note: "x".repeat(60),
                    };
                    uow.emit(&event).await.expect("emit");
                    accounts.push(account);
                }
                // A failed commit may have gone through (the connection broke after COMMIT
                // was sent): its events may take effect once, or not at all.
                let outcome = if uow.commit().await.is_ok() {
                    &committed
                } else {
                    &unknown
                };
                let mut counts = outcome.lock().unwrap();
                for a in accounts {
                    *counts.entry(a).or_default() += 1;
                }
            }
        }));
    }

    let mut held: Option<HeldTransaction> = None;
    let mut file = std::fs::File::create(&o.out).expect("--out");
    let header =
        "t_s,emitted,handled,lat_p50_ms,lat_p99_ms,outbox_bytes,outbox_dead,outbox_partitions,\
                  processed_bytes,processed_dead,processed_partitions,inbox_bytes,inbox_dead,\
                  unpublished,oldest_unpublished_ms,oldest_snapshot_xids,warnings";
    writeln!(file, "{header}").unwrap();
    eprintln!(
        "autovacuum={autovacuum}, {} events/s in transactions of {}, {} min, outbox {}, dedup {} \
         ({} min partitions), retention {} min",
        o.rate, o.per_tx, o.minutes, o.outbox, o.dedup, o.width_minutes, o.retention_minutes
    );
    let start = Instant::now();
    let run = Duration::from_secs(o.minutes * 60);
    let thresholds = HealthThresholds::default();
    let mut windows: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut first_seen: BTreeMap<String, (u64, String)> = BTreeMap::new();
    let mut samples: Vec<Sample> = Vec::new();
    let mut hold_started = None;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + SAMPLE, SAMPLE);
    let mut draining_since: Option<(Instant, i64)> = None;
    loop {
        tick.tick().await;
        let t = start.elapsed().as_secs();
        if let Some(at) = o.hold_at {
            if held.is_none() && hold_started.is_none() && t >= at {
                held = Some(HeldTransaction::open(&db.url, "forgotten-session").await);
                hold_started = Some(t);
            }
            if let (Some(h), Some(s)) = (held.take(), hold_started) {
                if t >= s + o.hold_secs {
                    h.commit().await;
                } else {
                    held = Some(h);
                }
            }
        }
        let mut lat = std::mem::take(&mut *seen.latencies.lock().unwrap());
        lat.sort_unstable();
        windows
            .entry(t / WINDOW_SECS)
            .or_default()
            .extend_from_slice(&lat);
        let mut tables = [(0, 0, 0); 3];
        for (i, table) in ["outbox_event", "processed_event", "inbox_event"]
            .iter()
            .enumerate()
        {
            tables[i] = sqlx::query_as(TABLE_SQL)
                .bind(table)
                .fetch_one(&admin_pool)
                .await
                .unwrap();
        }
        let (unpublished, oldest_unpublished_ms): (i64, i64) = sqlx::query_as(
            "SELECT count(*), coalesce((1000 * extract(epoch FROM clock_timestamp() \
                 - min(created_at)))::int8, 0) \
             FROM outbox_event WHERE published_at IS NULL",
        )
        .fetch_one(&admin_pool)
        .await
        .unwrap();
        let oldest_snapshot_xids: i64 = sqlx::query_scalar(
            "SELECT coalesce(max(greatest(age(backend_xmin), age(backend_xid))), 0)::int8 \
             FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
               AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)",
        )
        .fetch_one(&admin_pool)
        .await
        .unwrap();
        let handled = seen.runs.load(std::sync::atomic::Ordering::Relaxed);
        let health = admin::health(&admin_pool, &thresholds)
            .await
            .expect("health");
        let mut kinds: Vec<String> = Vec::new();
        for w in &health.warnings {
            let kind = w.kind().to_string();
            first_seen
                .entry(kind.clone())
                .or_insert_with(|| (t, w.to_string()));
            kinds.push(kind);
        }
        kinds.sort();
        kinds.dedup();
        let emitted: u64 = committed.lock().unwrap().values().sum();
        let sample = Sample {
            t,
            emitted,
            handled,
            p50: percentile(&lat, 0.5),
            p99: percentile(&lat, 0.99),
            tables,
            unpublished,
            oldest_unpublished_ms,
            oldest_snapshot_xids,
            warnings: kinds.join("|"),
        };
        writeln!(
            file,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            sample.t,
            sample.emitted,
            sample.handled,
            sample.p50,
            sample.p99,
            sample.tables[0].0,
            sample.tables[0].1,
            sample.tables[0].2,
            sample.tables[1].0,
            sample.tables[1].1,
            sample.tables[1].2,
            sample.tables[2].0,
            sample.tables[2].1,
            sample.unpublished,
            sample.oldest_unpublished_ms,
            sample.oldest_snapshot_xids,
            sample.warnings
        )
        .unwrap();
        file.flush().unwrap();
        eprintln!(
            "{:>5}s emitted {:>8} handled {:>8} p99 {:>5} ms outbox {:>6} kB processed {:>6} kB ({} partitions) {}",
            sample.t,
            sample.emitted,
            sample.handled,
            sample.p99,
            sample.tables[0].0 / 1024,
            sample.tables[1].0 / 1024,
            sample.tables[1].2,
            sample.warnings
        );
        samples.push(sample);
        if start.elapsed() >= run && !stop_emitting.is_cancelled() {
            stop_emitting.cancel();
            for e in emitters.drain(..) {
                e.await.unwrap();
            }
            draining_since = Some((Instant::now(), handled));
            eprintln!("emitters stopped; draining");
        }
        if let Some((since, progress)) = draining_since {
            // Done when no account's counter is short of what was committed to it (a sum
            // would count an effect twice as one that is missing).
            let committed = committed.lock().unwrap().clone();
            let effects = effects_by_account(&admin_pool).await;
            if committed
                .iter()
                .all(|(a, want)| effects.get(a).unwrap_or(&0) >= want)
            {
                break;
            }
            if handled > progress {
                draining_since = Some((Instant::now(), handled));
            } else if since.elapsed() > Duration::from_secs(60) {
                eprintln!("no progress for 60 s: {handled} handled");
                break;
            }
        }
    }
    drop(held);
    cancel.cancel();
    let _ = relay_task.await;
    let _ = consumer_task.await;

    // Effects once, nothing lost: each account's counter against what was committed.
    let effects = effects_by_account(&admin_pool).await;
    let committed = committed.lock().unwrap().clone();
    let unknown = unknown.lock().unwrap().clone();
    let (mut lost, mut extra) = (0u64, 0u64);
    let accounts: std::collections::BTreeSet<&String> =
        committed.keys().chain(effects.keys()).collect();
    for account in accounts {
        let n = *effects.get(account).unwrap_or(&0);
        let want = *committed.get(account).unwrap_or(&0);
        let may = *unknown.get(account).unwrap_or(&0);
        lost += want.saturating_sub(n);
        extra += n.saturating_sub(want + may);
    }
    let total: u64 = committed.values().sum();

    println!(
        "autovacuum={autovacuum}; outbox {}; dedup {}; {} events committed in {} min ({:.0}/s); \
         lost {lost}; effects more than once {extra}; commits of unknown outcome {}",
        o.outbox,
        o.dedup,
        total,
        o.minutes,
        total as f64 / run.as_secs_f64(),
        unknown.values().sum::<u64>()
    );
    let p99s: Vec<(u64, u32, usize)> = windows
        .iter_mut()
        .map(|(w, v)| {
            v.sort_unstable();
            (*w, percentile(v, 0.99), v.len())
        })
        .collect();
    for (w, p99, n) in &p99s {
        println!(
            "window {:>3}-{:<3} min: emit->handle p99 {p99} ms ({n} events)",
            w * WINDOW_SECS / 60,
            (w + 1) * WINDOW_SECS / 60
        );
    }
    let full: Vec<&(u64, u32, usize)> = p99s
        .iter()
        .filter(|(w, _, _)| (w + 1) * WINDOW_SECS <= o.minutes * 60)
        .collect();
    if full.len() >= 2 {
        let (second, last) = (full[1].1, full[full.len() - 1].1);
        println!(
            "p99: last full window {last} ms, second {second} ms: {:.2}x",
            f64::from(last) / f64::from(second.max(1))
        );
    }
    let total_bytes = |s: &Sample| s.tables.iter().map(|t| t.0).sum::<i64>();
    if let (Some(at20), Some(last)) = (
        samples.iter().find(|s| s.t >= 1200),
        samples.iter().rev().find(|s| s.t <= o.minutes * 60),
    ) {
        println!(
            "outbox tables: {} kB at {} s, {} kB at {} s: {:.2}x",
            total_bytes(at20) / 1024,
            at20.t,
            total_bytes(last) / 1024,
            last.t,
            total_bytes(last) as f64 / total_bytes(at20).max(1) as f64
        );
    }
    if let Some(at) = hold_started {
        println!(
            "a session held the horizon from {at} s for {} s",
            o.hold_secs
        );
    }
    for (kind, (t, text)) in &first_seen {
        println!("warning {kind} first at {t} s: {text}");
    }
    if lost > 0 || extra > 0 {
        std::process::exit(1);
    }
}
