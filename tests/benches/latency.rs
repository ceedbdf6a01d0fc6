//! Commit to handler, end to end, as a user has it: one relay and one consumer with the shipped
//! defaults, in one process, an emitter committing one event per unit of work at a steady rate
//! over a set of keys, for each broker and consumer mode.
//!
//! - An event's latency is from right after its `commit()` returned (an `Instant` kept by its
//!   number) to the first call of the handler with it.
//! - **Start-up is excluded**: the consumer, the relay and the emitter start together; the run
//!   is measured only from the moment the consumer first handled an event within 50 ms of its
//!   commit (it is handling, its backlog from start-up caught up), and only events committed
//!   from then on count. That moment, from the consumer's start, is printed as `start-up`. If
//!   no event is handled within 50 ms in 30 s (inbox mode while processors poll), the run is
//!   measured from 2 s after the first event handled, and `start-up` says so.
//! - Figures per window of `WINDOW` seconds (so a stall shows) and for the whole run: p50, p90,
//!   p99, max. `relay lag` is the oldest unpublished row's age, sampled every 100 ms: the
//!   window's largest sample (the relay's share of the latency).
//!
//! `cargo bench -p outbox-tests --bench latency` (env: `RATE` events/s, default 500; `KEYS`,
//! default 100; `SECS` measured, default 20; `WINDOW` s, default 5; `BROKERS`, default
//! `mock,tansu,jetstream,rabbitmq`; `MODES`, default `dedup,inbox`). Each run has a database,
//! and a broker, of its own: a librdkafka mock cluster of one broker (as the quickstart and
//! `outbox dev-broker` have), a tansu process (skipped when its binary is missing), a
//! nats-server process; RabbitMQ is the machine's node (the run's group names its queues,
//! deleted at the end).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_runtime::inbox::{Consumer, ConsumerBuilder, HandlerError, Mode};
use outbox_runtime::rabbitmq::RabbitMq;
use outbox_runtime::relay::{JetStream, Relay, RelayBuilder};
use outbox_runtime::testing::MockKafka;
use outbox_runtime::{inbox_handler, OutboxEvent, Uow};
use outbox_tests::bench::{env, percentile};
use outbox_tests::kafka::{tansu_bin, Kafka};
use outbox_tests::nats::NatsServer;
use outbox_tests::rabbitmq::{delete_queue, unique_name, SHARED_URL};
use outbox_tests::{Running, TestDb};
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "bench.latency";
/// The Kafka topic's partitions (the quickstart's topics have 4; a busier service more).
const PARTITIONS: i32 = 12;
/// Handled within this of its commit: the consumer is handling (start-up is over).
const READY_WITHIN: Duration = Duration::from_millis(50);

/// The event: its number in the run, and its key.
#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(
    topic = "bench.latency",
    aggregate_type = "Account",
    event_type = "Ticked"
)]
struct Ticked {
    #[outbox(aggregate_id)]
    key: String,
    n: u64,
}

/// A run's clock: when each event committed and was first handled.
#[derive(Default)]
struct Clock {
    committed: Mutex<HashMap<u64, Instant>>,
    handled: Mutex<HashMap<u64, Instant>>,
    /// The first moment an event was handled within [`READY_WITHIN`], and the first at all.
    ready: Mutex<(Option<Instant>, Option<Instant>)>,
}

impl Clock {
    fn committed(&self, n: u64) {
        self.committed.lock().unwrap().insert(n, Instant::now());
    }

    fn handled(&self, n: u64) {
        let now = Instant::now();
        let first = {
            let mut handled = self.handled.lock().unwrap();
            let first = !handled.contains_key(&n);
            handled.entry(n).or_insert(now);
            first
        };
        if !first {
            return;
        }
        let committed = self.committed.lock().unwrap().get(&n).copied();
        let mut ready = self.ready.lock().unwrap();
        ready.1.get_or_insert(now);
        if ready.0.is_none() && committed.is_some_and(|c| now - c <= READY_WITHIN) {
            ready.0 = Some(now);
        }
    }
}

#[inbox_handler]
async fn handle(
    event: Ticked,
    tx: &mut sqlx::PgConnection,
    clock: &Arc<Clock>,
) -> Result<(), HandlerError> {
    let _ = tx;
    clock.handled(event.n);
    Ok(())
}

/// Commits one event per unit of work, `rate` a second over `keys` keys, until `stop`.
async fn emit(
    pool: sqlx::PgPool,
    clock: Arc<Clock>,
    rate: f64,
    keys: u64,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = tokio::task::JoinSet::new();
    let mut n = 0u64;
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let (pool, clock) = (pool.clone(), Arc::clone(&clock));
        tasks.spawn(async move {
            let mut uow = Uow::begin(&pool).await.expect("begin");
            uow.emit(&Ticked {
                key: format!("key-{}", n % keys),
                n,
            })
            .await
            .expect("emit");
            uow.commit().await.expect("commit");
            clock.committed(n);
        });
        n += 1;
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

/// The oldest unpublished row's age, every 100 ms, until `stop`.
async fn sample_relay_lag(pool: sqlx::PgPool, stop: CancellationToken) -> Vec<(Instant, Duration)> {
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            () = stop.cancelled() => return samples,
            _ = tick.tick() => {}
        }
        let age: Option<f64> = sqlx::query_scalar(
            "SELECT (EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)) * 1000)::float8 \
             FROM outbox_event WHERE published_at IS NULL",
        )
        .fetch_one(&pool)
        .await
        .expect("oldest unpublished");
        let age = Duration::from_secs_f64(age.unwrap_or(0.0).max(0.0) / 1000.0);
        samples.push((Instant::now(), age));
    }
}

/// A broker of one run.
enum Broker {
    Kafka(Kafka),
    JetStream(NatsServer),
    RabbitMq,
}

impl Broker {
    async fn start(name: &str) -> Broker {
        match name {
            "mock" => Broker::Kafka(Kafka::Mock(MockKafka::start().expect("mock cluster"))),
            "tansu" => Broker::Kafka(Kafka::tansu().await),
            "jetstream" => Broker::JetStream(NatsServer::start().await),
            "rabbitmq" => Broker::RabbitMq,
            other => panic!("no broker {other}: mock, tansu, jetstream or rabbitmq"),
        }
    }

    async fn prepare(&self) {
        if let Broker::Kafka(kafka) = self {
            kafka.create_topic(TOPIC, PARTITIONS).await;
            kafka
                .create_topic(&format!("{TOPIC}.retry"), PARTITIONS)
                .await;
            kafka.create_topic(&format!("{TOPIC}.dlq"), 1).await;
        }
    }

    async fn relay(&self, relay: RelayBuilder) -> RelayBuilder {
        match self {
            Broker::Kafka(kafka) => relay.brokers(kafka.bootstrap()),
            Broker::JetStream(server) => {
                relay.jetstream(JetStream::new(server.client().await).create_streams(true))
            }
            Broker::RabbitMq => relay.rabbitmq(RabbitMq::new(SHARED_URL)),
        }
    }

    async fn consumer(&self, consumer: ConsumerBuilder<Arc<Clock>>) -> ConsumerBuilder<Arc<Clock>> {
        match self {
            // The mock's consumers as the quickstart and the test kit make them.
            Broker::Kafka(Kafka::Mock(mock)) => consumer
                .brokers(mock.bootstrap_servers())
                .consumer_config(mock.consumer_config()),
            Broker::Kafka(kafka) => consumer.brokers(kafka.bootstrap()),
            Broker::JetStream(server) => {
                consumer.jetstream(JetStream::new(server.client().await).create_streams(true))
            }
            Broker::RabbitMq => consumer.rabbitmq(RabbitMq::new(SHARED_URL)),
        }
    }
}

/// What a run measured.
struct Outcome {
    rows: Vec<String>,
    whole: String,
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

/// p50 | p90 | p99 | max of `latencies` (sorted here).
fn quantiles(latencies: &mut [Duration]) -> String {
    if latencies.is_empty() {
        return "- | - | - | -".to_owned();
    }
    let max = *latencies.iter().max().unwrap();
    format!(
        "{} | {} | {} | {}",
        ms(percentile(latencies, 0.5)),
        ms(percentile(latencies, 0.9)),
        ms(percentile(latencies, 0.99)),
        ms(max)
    )
}

struct Load {
    rate: f64,
    keys: u64,
    secs: u64,
    window: u64,
}

async fn run(broker_name: &str, mode: Mode, load: &Load) -> Outcome {
    let mode_name = match mode {
        Mode::Dedup => "dedup",
        Mode::Inbox => "inbox",
    };
    let label = format!("{broker_name}, {mode_name}");
    let db = TestDb::new().await;
    let emitter_pool = db.pool(16).await;
    let broker = Broker::start(broker_name).await;
    broker.prepare().await;
    let group = unique_name("latency");
    let clock = Arc::new(Clock::default());
    let consumer = broker
        .consumer(Consumer::builder(db.pool.clone()).state(Arc::clone(&clock)))
        .await
        .group_id(&group)
        .handler(handle)
        .mode(mode)
        .build()
        .expect("consumer");
    let relay = broker
        .relay(Relay::builder(db.pool.clone()))
        .await
        .build()
        .expect("relay");
    let started = Instant::now();
    let consuming = Running::consumer(&consumer);
    let relaying = Running::relay(&relay);
    let stop_emitting = CancellationToken::new();
    let emitter = tokio::spawn(emit(
        emitter_pool,
        Arc::clone(&clock),
        load.rate,
        load.keys,
        stop_emitting.clone(),
    ));
    let stop_sampling = CancellationToken::new();
    let sampler = tokio::spawn(sample_relay_lag(db.pool.clone(), stop_sampling.clone()));

    // Start-up: until an event is handled within READY_WITHIN of its commit.
    let (from, startup) = loop {
        let (ready, first) = *clock.ready.lock().unwrap();
        if let Some(at) = ready {
            break (at, format!("{:.2} s", (at - started).as_secs_f64()));
        }
        if started.elapsed() > Duration::from_secs(30) {
            match first {
                Some(first) => {
                    break (
                        first + Duration::from_secs(2),
                        format!(
                            "none within 50 ms in 30 s; first handled {:.2} s",
                            (first - started).as_secs_f64()
                        ),
                    )
                }
                None => panic!("{label}: nothing handled in 30 s"),
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let until = from + Duration::from_secs(load.secs);
    tokio::time::sleep_until(until.max(Instant::now()).into()).await;
    stop_emitting.cancel();
    emitter.await.expect("emitter");
    // Every event committed in the measured span handled (or 30 s).
    let measured: Vec<(u64, Instant)> = clock
        .committed
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, &c)| c >= from && c < until)
        .map(|(&n, &c)| (n, c))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let done = {
            let handled = clock.handled.lock().unwrap();
            measured.iter().all(|(n, _)| handled.contains_key(n))
        };
        if done || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop_sampling.cancel();
    let lag = sampler.await.expect("sampler");
    Running::stop_all([consuming, relaying]).await;

    let handled = clock.handled.lock().unwrap().clone();
    let mut missing = 0;
    let mut windows: Vec<Vec<Duration>> =
        vec![Vec::new(); load.secs.div_ceil(load.window) as usize];
    let mut all = Vec::with_capacity(measured.len());
    for (n, committed) in &measured {
        let Some(at) = handled.get(n) else {
            missing += 1;
            continue;
        };
        let latency = at.saturating_duration_since(*committed);
        let last = windows.len() - 1;
        let w = ((*committed - from).as_secs() / load.window) as usize;
        windows[w.min(last)].push(latency);
        all.push(latency);
    }
    let lag_in = |a: Instant, b: Instant| {
        lag.iter()
            .filter(|(t, _)| *t >= a && *t < b)
            .map(|(_, d)| *d)
            .max()
            .map_or_else(|| "-".to_owned(), ms)
    };
    let mut rows = Vec::new();
    for (w, latencies) in windows.iter_mut().enumerate() {
        let a = from + Duration::from_secs(w as u64 * load.window);
        let b = (a + Duration::from_secs(load.window)).min(until);
        rows.push(format!(
            "| {label} | {}-{} s | {} | {} | {} |",
            w as u64 * load.window,
            ((w as u64 + 1) * load.window).min(load.secs),
            latencies.len(),
            quantiles(latencies),
            lag_in(a, b)
        ));
    }
    let whole = format!(
        "| {label} | {} | {} | {} | {startup} |{}",
        all.len(),
        quantiles(&mut all),
        lag_in(from, until),
        if missing > 0 {
            format!(" {missing} not handled within 30 s")
        } else {
            String::new()
        }
    );
    if let Broker::RabbitMq = broker {
        for shard in 0..4 {
            delete_queue(SHARED_URL, &format!("{TOPIC}.{group}.{shard}")).await;
            delete_queue(SHARED_URL, &format!("{TOPIC}.{group}.{shard}.retry")).await;
        }
    }
    drop(broker);
    Outcome { rows, whole }
}

#[tokio::main]
async fn main() {
    let load = Load {
        rate: env("RATE", 500.0),
        keys: env("KEYS", 100),
        secs: env("SECS", 20),
        window: env("WINDOW", 5),
    };
    let brokers: String = env("BROKERS", "mock,tansu,jetstream,rabbitmq".to_owned());
    let modes: String = env("MODES", "dedup,inbox".to_owned());
    println!(
        "commit -> handler latency: {} events/s over {} keys, {} s measured per run (windows of \
         {} s), one relay and one consumer, shipped defaults",
        load.rate, load.keys, load.secs, load.window
    );
    let mut wholes = Vec::new();
    for broker in brokers.split(',').map(str::trim).filter(|b| !b.is_empty()) {
        if broker == "tansu" && !tansu_bin().exists() {
            println!("tansu: skipped, no binary at {}", tansu_bin().display());
            continue;
        }
        for mode in modes.split(',').map(str::trim).filter(|m| !m.is_empty()) {
            let mode = match mode {
                "dedup" => Mode::Dedup,
                "inbox" => Mode::Inbox,
                other => panic!("no mode {other}: dedup or inbox"),
            };
            let outcome = run(broker, mode, &load).await;
            println!("| broker, mode | window | events | p50 ms | p90 ms | p99 ms | max ms | relay lag ms |");
            println!("|---|---|---|---|---|---|---|---|");
            for row in &outcome.rows {
                println!("{row}");
            }
            println!("{}", outcome.whole);
            wholes.push(outcome.whole);
        }
    }
    println!();
    println!("whole runs:");
    println!(
        "| broker, mode | events | p50 ms | p90 ms | p99 ms | max ms | relay lag ms | start-up |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for whole in wholes {
        println!("{whole}");
    }
}
