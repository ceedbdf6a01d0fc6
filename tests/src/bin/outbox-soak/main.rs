//! The fault-injection soak: emitters, three relay processes and a consumer run for a while
//! against a fresh database and the mock Kafka cluster, while faults are injected at random
//! (seeded): relay processes killed with SIGKILL and restarted, relay connections terminated
//! by the server, produce errors and latency on the brokers, a PostgreSQL restart. At the end
//! it waits for the outbox to drain and checks, on the broker: every committed event arrived,
//! none that failed to commit did, and each key's events arrived in order.
//!
//! With `--transport nats` the relays publish to NATS JetStream instead: a nats-server of its
//! own (file store), killed with SIGKILL and started again, or restarted gracefully, in place of
//! the produce errors and latency; the check reads the stream. With `--transport rabbitmq`
//! they publish to a RabbitMQ node of the soak's own, killed with SIGKILL and started again;
//! the check reads one durable queue per shard (`readers.rs`).
//!
//! With `--database mariadb` the outbox is on a MariaDB server of the soak's own (`mariadbd`,
//! its own data directory and port): the server is killed with SIGKILL and started again in
//! place of the PostgreSQL restart, and the relays' sessions are killed with `KILL CONNECTION`.
//!
//! ```text
//! cargo run --release -p outbox-tests --bin outbox-soak -- --seconds 60 [--seed N] [--transport kafka|nats|rabbitmq] [--database postgres|mariadb]
//! ```
//!
//! Prints one line and exits non-zero on any loss, phantom or order violation. On PostgreSQL
//! it restarts the machine's server: run it alone.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod readers;

use outbox_runtime::rabbitmq::RabbitMq;
use outbox_runtime::relay::{JetStream, Relay};
use outbox_tests::deposits::{deposit, Emitted};
use outbox_tests::kafka::Kafka;
use outbox_tests::mysql::MariaDbServer;
use outbox_tests::nats::NatsServer;
use outbox_tests::rabbitmq::{declare_queue_bound, RabbitNode};
use outbox_tests::{restart_postgres, ChildGuard, TestDb};
use rdkafka::types::RDKafkaRespErr;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "account.events";
/// Many partitions: the mock cluster keeps at most 5 MB of each partition's log, and a soak
/// writes a lot.
const PARTITIONS: i32 = 24;
const RELAYS: usize = 3;
const EMITTERS: usize = 4;
const KEYS_PER_EMITTER: usize = 50;

/// A small seeded generator (xorshift64*): the same seed, the same faults at the same moments.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to - from + 1))
    }
}

/// The stream of the JetStream mode.
const STREAM: &str = "SOAK";

/// The shards of the RabbitMQ mode (a queue each).
const SHARDS: u16 = 4;

/// Where the relays publish.
#[derive(Clone, Copy, PartialEq, Eq)]
enum To {
    Kafka,
    Nats,
    RabbitMq,
}

/// Options from the command line.
struct Options {
    to: To,
    seconds: u64,
    seed: u64,
    mariadb: bool,
}

fn options() -> Options {
    let mut args = std::env::args().skip(1);
    let mut seconds = 60;
    let mut to = To::Kafka;
    let mut mariadb = false;
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        | 1;
    while let Some(arg) = args.next() {
        let value = args.next().unwrap_or_default();
        match arg.as_str() {
            "--seconds" => seconds = value.parse().expect("--seconds N"),
            "--seed" => seed = value.parse::<u64>().expect("--seed N") | 1,
            "--transport" if value == "kafka" => to = To::Kafka,
            "--transport" if value == "nats" => to = To::Nats,
            "--transport" if value == "rabbitmq" => to = To::RabbitMq,
            "--database" if value == "postgres" => mariadb = false,
            "--database" if value == "mariadb" => mariadb = true,
            _ => {
                eprintln!(
                    "usage: outbox-soak [--seconds N] [--seed N] [--transport kafka|nats|rabbitmq] \
                     [--database postgres|mariadb]"
                );
                std::process::exit(2);
            }
        }
    }
    Options {
        to,
        seconds,
        seed,
        mariadb,
    }
}

/// `outbox-soak relay DATABASE_URL BROKERS`: one relay process, until killed (BROKERS a
/// `nats://` URL: to JetStream; an `amqp://` one: to RabbitMQ). With
/// `OUTBOX_SOAK_LOGS=dir`, it logs the relay's debug events to `dir/relay-<pid>.log`.
async fn relay_process(url: &str, brokers: &str) {
    if let Some(dir) = std::env::var_os("OUTBOX_SOAK_LOGS") {
        let path = std::path::Path::new(&dir).join(format!("relay-{}.log", std::process::id()));
        let file = std::fs::File::create(path).expect("relay log");
        tracing_subscriber::fmt()
            .with_writer(Mutex::new(file))
            .with_ansi(false)
            .with_max_level(tracing::Level::TRACE)
            .init();
    }
    let pool: outbox_runtime::relay::Database = if url.starts_with("mysql://") {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(4)
            .connect_lazy(url)
            .expect("database url")
            .into()
    } else {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_lazy(url)
            .expect("database url")
            .into()
    };
    // Kafka refuses produce requests whose idempotent sequence numbers do not follow on from
    // the last one it wrote, so nothing is written past a refused record; the mock cluster does
    // not check them, and the relay sends one record per key at a time instead.
    let builder = if brokers.starts_with("nats://") {
        let client = outbox_runtime::async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(brokers)
            .await
            .expect("nats url");
        Relay::builder(pool).jetstream(JetStream::new(client))
    } else if brokers.starts_with("amqp://") {
        Relay::builder(pool).rabbitmq(RabbitMq::new(brokers).shards(SHARDS))
    } else {
        Relay::builder(pool)
            .brokers(brokers)
            .one_record_in_flight_per_key(true)
    };
    let relay = builder
        .poll_interval(Duration::from_millis(100))
        .publish_timeout(Duration::from_secs(5))
        // Injected refusals are passing: never park for them.
        .max_attempts(1_000_000)
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .build()
        .expect("relay");
    relay.run(CancellationToken::new()).await.expect("relay");
}

fn start_relay(url: &str, brokers: &str) -> ChildGuard {
    ChildGuard(
        Command::new(std::env::current_exe().expect("own path"))
            .args(["relay", url, brokers])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start a relay process"),
    )
}

/// Emits units of work of 1 to 3 events over its own keys until `stop`, numbering each key's
/// events in order; a unit of work that fails is recorded, not retried.
async fn emitter<DB: outbox_runtime::EmitDatabase>(
    pool: sqlx::Pool<DB>,
    task: usize,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> Emitted {
    let mut rng = Rng(seed);
    let mut ledger = Emitted::default();
    let mut seq = [0u64; KEYS_PER_EMITTER];
    while !stop.load(Ordering::SeqCst) {
        let k = rng.below(KEYS_PER_EMITTER as u64) as usize;
        let n = 1 + rng.below(3);
        let events: Vec<_> = (0..n)
            .map(|j| deposit(task * KEYS_PER_EMITTER + k, seq[k] + j))
            .collect();
        seq[k] += n;
        if !ledger.unit_of_work(&pool, &events).await {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(rng.millis(1, 4)).await;
    }
    ledger
}

/// Everything read off the topic, in arrival order per partition: `(key, seq)`, and where it
/// was (partition, offset), for the report of a violation.
type Received = Arc<Mutex<Vec<((String, u64), (i32, i64, String))>>>;

/// The faults injected, by kind.
#[derive(Default)]
struct Faults(BTreeMap<&'static str, u32>);

impl Faults {
    fn add(&mut self, kind: &'static str) {
        *self.0.entry(kind).or_default() += 1;
    }
}

impl std::fmt::Display for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|(k, n)| format!("{k} {n}")).collect();
        write!(f, "{}", parts.join(", "))
    }
}

const PRODUCE_ERRORS: [RDKafkaRespErr; 5] = [
    RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
    RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
    RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
    RDKafkaRespErr::RD_KAFKA_RESP_ERR_POLICY_VIOLATION,
    RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER,
];

/// The outbox's database: the machine's PostgreSQL (a fresh database), or a MariaDB server of
/// the soak's own.
enum Store {
    Postgres(TestDb, sqlx::PgPool),
    MariaDb(MariaDbServer, sqlx::MySqlPool),
}

impl Store {
    async fn open(mariadb: bool) -> Store {
        if mariadb {
            let server = MariaDbServer::start().await;
            let pool = server.database("soak", 10).await;
            Store::MariaDb(server, pool)
        } else {
            let db = TestDb::new().await;
            let pool = db.pool(10).await;
            Store::Postgres(db, pool)
        }
    }

    fn url(&self) -> String {
        match self {
            Store::Postgres(db, _) => db.url.clone(),
            Store::MariaDb(server, _) => server.url("soak"),
        }
    }

    /// The emitter of task `task`.
    fn emitter(&self, task: usize, seed: u64, stop: Arc<AtomicBool>) -> JoinHandle<Emitted> {
        match self {
            Store::Postgres(_, pool) => tokio::spawn(emitter(pool.clone(), task, seed, stop)),
            Store::MariaDb(_, pool) => tokio::spawn(emitter(pool.clone(), task, seed, stop)),
        }
    }

    /// Ends one relay session (or all) from the server's side.
    async fn terminate_relay_connections(&self, all: bool) {
        let limit = if all { "" } else { " LIMIT 1" };
        match self {
            Store::Postgres(_, pool) => {
                let sql = format!(
                    "SELECT count(pg_terminate_backend(pid)) FROM (SELECT pid FROM \
                     pg_stat_activity WHERE application_name = 'outbox-relay' \
                     AND datname = current_database() ORDER BY random(){limit}) AS chosen"
                );
                let _ = sqlx::query(&sql).execute(pool).await;
            }
            Store::MariaDb(_, pool) => {
                // A relay's session holds its member lock (`outbox:r:<MD5 of the database>:m:
                // <slot>`): the connection holding it is the session.
                let sql = format!(
                    "SELECT CAST(IS_USED_LOCK(CONCAT('outbox:r:', MD5(DATABASE()), ':m:', \
                         bucket)) AS SIGNED) AS id \
                     FROM outbox_key_lock WHERE bucket < 256 \
                       AND IS_USED_LOCK(CONCAT('outbox:r:', MD5(DATABASE()), ':m:', bucket)) \
                           IS NOT NULL \
                     ORDER BY RAND(){limit}"
                );
                // (A lock freed between the two reads of a row reads NULL the second time.)
                let sessions: Vec<Option<i64>> =
                    match sqlx::query_scalar(&sql).fetch_all(pool).await {
                        Ok(sessions) => sessions,
                        Err(e) => {
                            eprintln!("cannot list the relay sessions: {e}");
                            Vec::new()
                        }
                    };
                for id in sessions.into_iter().flatten() {
                    let _ = sqlx::query(&format!("KILL CONNECTION {id}"))
                        .execute(pool)
                        .await;
                }
            }
        }
    }

    /// The database's server restarted (PostgreSQL, gracefully) or killed with SIGKILL and
    /// started again (MariaDB). Returns the fault's name.
    async fn restart(&mut self, rng: &mut Rng) -> &'static str {
        match self {
            Store::Postgres(..) => {
                restart_postgres().await;
                "postgres restart"
            }
            Store::MariaDb(server, _) => {
                server.kill();
                tokio::time::sleep(rng.millis(200, 1_500)).await;
                server.restart().await;
                "mariadb SIGKILL"
            }
        }
    }

    /// Unpublished outbox rows; `None` while the server does not answer.
    async fn unpublished(&self) -> Option<i64> {
        let sql = "SELECT count(*) FROM outbox_event WHERE published_at IS NULL";
        match self {
            Store::Postgres(_, pool) => sqlx::query_scalar(sql).fetch_one(pool).await.ok(),
            Store::MariaDb(_, pool) => sqlx::query_scalar(sql).fetch_one(pool).await.ok(),
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("relay") {
        let [_, _, url, brokers] = args.as_slice() else {
            eprintln!("usage: outbox-soak relay DATABASE_URL BROKERS");
            std::process::exit(2);
        };
        relay_process(url, brokers).await;
        return;
    }
    let options = options();
    println!(
        "outbox soak: {} s, seed {} (rerun with --seed {})",
        options.seconds, options.seed, options.seed
    );
    let mut rng = Rng(options.seed);
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let mut nats = None;
    let mut rabbitmq = None;
    let mut bootstrap = kafka.bootstrap();
    let mut queues = Vec::new();
    match options.to {
        To::Kafka => {}
        To::Nats => {
            let server = NatsServer::start().await;
            server.create_stream(STREAM, TOPIC, |_| {}).await;
            bootstrap = server.url();
            nats = Some(server);
        }
        To::RabbitMq => {
            let node = RabbitNode::start().await;
            // Durable classic queues, one per shard, declared before the first publish.
            for shard in 0..SHARDS {
                let queue = format!("soak.{shard}");
                declare_queue_bound(&node.url(), &queue, TOPIC, &shard.to_string()).await;
                queues.push(queue);
            }
            bootstrap = node.url();
            rabbitmq = Some(node);
        }
    }
    let mut store = Store::open(options.mariadb).await;
    let url = store.url();

    let mut relays: Vec<Option<ChildGuard>> = (0..RELAYS)
        .map(|_| Some(start_relay(&url, &bootstrap)))
        .collect();
    let received: Received = Arc::default();
    let cancel = CancellationToken::new();
    let consumer_task = match (&nats, &rabbitmq) {
        (Some(_), _) => tokio::spawn(readers::stream_reader(
            bootstrap.clone(),
            received.clone(),
            cancel.clone(),
        )),
        (_, Some(node)) => tokio::spawn(readers::queue_reader(
            node.port(),
            queues.clone(),
            received.clone(),
            cancel.clone(),
        )),
        _ => tokio::spawn(readers::consumer(
            bootstrap.clone(),
            received.clone(),
            cancel.clone(),
        )),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let emitters: Vec<_> = (0..EMITTERS)
        .map(|t| store.emitter(t, rng.next() | 1, stop.clone()))
        .collect();

    // Faults, one every 0.5 to 2 s; the database server's restart once, near the middle.
    let mut faults = Faults::default();
    let started = Instant::now();
    let run_for = Duration::from_secs(options.seconds);
    let restart_at = run_for / 2 + rng.millis(0, 2_000);
    let mut restarted = false;
    let mut down: Vec<(usize, Instant)> = Vec::new();
    while started.elapsed() < run_for {
        tokio::time::sleep(rng.millis(500, 2_000)).await;
        // Bring back relays killed earlier.
        let now = Instant::now();
        for (i, at) in std::mem::take(&mut down) {
            if now >= at {
                relays[i] = Some(start_relay(&url, &bootstrap));
            } else {
                down.push((i, at));
            }
        }
        if !restarted && started.elapsed() >= restart_at {
            restarted = true;
            faults.add(store.restart(&mut rng).await);
            continue;
        }
        match rng.below(5) {
            0 => {
                let i = rng.below(RELAYS as u64) as usize;
                if let Some(mut relay) = relays[i].take() {
                    relay.kill();
                    faults.add("relay SIGKILL");
                    down.push((i, Instant::now() + rng.millis(200, 2_000)));
                }
            }
            1 => {
                let all = rng.below(4) == 0;
                store.terminate_relay_connections(all).await;
                faults.add(if all {
                    "all relay sessions terminated"
                } else {
                    "a relay session terminated"
                });
            }
            _ if rabbitmq.is_some() => {
                let node = rabbitmq.as_mut().expect("rabbitmq mode");
                node.kill();
                tokio::time::sleep(rng.millis(100, 1_500)).await;
                node.spawn().await;
                faults.add("rabbitmq SIGKILL");
            }
            2 | 3 if nats.is_some() => {
                let server = nats.as_mut().expect("nats mode");
                server.kill();
                tokio::time::sleep(rng.millis(100, 1_500)).await;
                server.spawn().await;
                faults.add("nats-server SIGKILL");
            }
            _ if nats.is_some() => {
                let server = nats.as_mut().expect("nats mode");
                server.terminate();
                server.spawn().await;
                faults.add("nats-server restart");
            }
            2 | 3 => {
                let n = 1 + rng.below(3) as usize;
                let errors: Vec<RDKafkaRespErr> = (0..n)
                    .map(|_| PRODUCE_ERRORS[rng.below(PRODUCE_ERRORS.len() as u64) as usize])
                    .collect();
                kafka.fail_produce_requests(&errors);
                faults.add("produce errors");
            }
            _ => {
                kafka.set_latency(rng.millis(20, 150));
                tokio::time::sleep(rng.millis(500, 2_000)).await;
                kafka.set_latency(Duration::ZERO);
                faults.add("broker latency");
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    let mut ledger = Emitted::default();
    for e in emitters {
        ledger.absorb(e.await.expect("emitter"));
    }
    // Every relay back up; the outbox drains, and the consumer catches up.
    for (i, _) in down.drain(..) {
        relays[i] = Some(start_relay(&url, &bootstrap));
    }
    let drained_by = Instant::now() + Duration::from_secs(180);
    loop {
        let left = store.unpublished().await;
        let got: HashSet<(String, u64)> = received
            .lock()
            .unwrap()
            .iter()
            .map(|(id, _)| id.clone())
            .collect();
        if left == Some(0) && ledger.committed.is_subset(&got) {
            break;
        }
        if Instant::now() >= drained_by {
            eprintln!("not drained after 180 s: {left:?} rows unpublished");
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cancel.cancel();
    let skipped = consumer_task.await.expect("consumer");
    drop(relays);

    // The verdict.
    let received = received.lock().unwrap().clone();
    let mut first: HashSet<(String, u64)> = HashSet::new();
    let mut last: HashMap<String, u64> = HashMap::new();
    let (mut duplicates, mut violations, mut phantoms) = (0u64, 0u64, 0u64);
    for (id, at) in &received {
        if ledger.failed.contains(id) {
            phantoms += 1;
        }
        if !first.insert(id.clone()) {
            duplicates += 1;
            continue;
        }
        if let Some(prev) = last.insert(id.0.clone(), id.1) {
            if prev > id.1 {
                violations += 1;
                eprintln!(
                    "order violation: key {} seq {} (partition {}, offset {}) after {prev}",
                    id.0, id.1, at.0, at.1
                );
                let around: Vec<String> = received
                    .iter()
                    .filter(|(other, _)| {
                        other.0 == id.0 && other.1 + 5 >= id.1 && other.1 <= prev + 5
                    })
                    .map(|(other, at)| format!("{}@{}:{}#{}", other.1, at.0, at.1, at.2))
                    .collect();
                eprintln!(
                    "  {} deliveries near it (seq@offset): {}",
                    id.0,
                    around.join(" ")
                );
            }
        }
    }
    let lost: Vec<&(String, u64)> = ledger.committed.difference(&first).collect();
    for (key, seq) in lost.iter().take(10) {
        let Store::Postgres(_, pool) = &store else {
            eprintln!("lost: {key} seq {seq}");
            continue;
        };
        let row: Option<(i64, Option<chrono::DateTime<chrono::Utc>>)> = sqlx::query_as(
            "SELECT id, published_at FROM outbox_event \
             WHERE partition_key = $1 AND (payload->>'seq')::int8 = $2",
        )
        .bind(key)
        .bind(*seq as i64)
        .fetch_optional(pool)
        .await
        .unwrap_or(None);
        eprintln!("lost: {key} seq {seq}: outbox row (id, published_at) {row:?}");
        if let Some((id, _)) = row {
            let id = id.to_string();
            let seen: Vec<String> = received
                .iter()
                .filter(|(_, at)| at.2 == id)
                .map(|(other, at)| format!("{other:?} at {}:{}", at.0, at.1))
                .collect();
            eprintln!("  its outbox id in what was read: {seen:?}");
        }
    }
    let lost = lost.len();
    println!(
        "committed {}, received {}, lost {lost}, duplicated {duplicates}, order violations \
         {violations}, phantoms {phantoms} (failed commits {}, unknown outcome {}); faults: {faults}",
        ledger.committed.len(),
        first.len(),
        ledger.failed.len(),
        ledger.unknown.len(),
    );
    if skipped > 0 {
        eprintln!(
            "the consumer fell behind the mock cluster's log ({skipped} offsets dropped before \
             they were read): the check is incomplete"
        );
    }
    if lost > 0 || violations > 0 || phantoms > 0 || skipped > 0 {
        std::process::exit(1);
    }
}
