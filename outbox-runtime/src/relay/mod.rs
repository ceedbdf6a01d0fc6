//! The relay: publishes the outbox to Kafka.
//!
//! ```no_run
//! use std::time::Duration;
//! use outbox_runtime::relay::Relay;
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let relay = Relay::builder(pool.clone())
//!     .brokers("127.0.0.1:9092")
//!     .batch_size(500)
//!     .poll_interval(Duration::from_millis(500))
//!     .build()?;
//! let cancel = CancellationToken::new();
//! let handle = relay.spawn(cancel.clone());
//! // ... the application runs ...
//! cancel.cancel();
//! handle.await??; // finishes the batch in flight, flushes, returns
//! # Ok(()) }
//! ```
//!
//! # How it works
//!
//! Each running instance (a [`Relay::spawn`] or [`Relay::run`]; several per process or across
//! processes) holds one PostgreSQL connection. Partition keys are spread over 64 shards
//! (`hashtext(partition_key) & 63`); through session advisory locks every instance owns a fair
//! share of the shards, and only the owner publishes a shard's rows. A batch claims the owned
//! shards' unpublished rows `ORDER BY id ... FOR UPDATE SKIP LOCKED`, enqueues them all on the
//! idempotent producer (`acks=all`) in that order, waits for the acknowledgements (at most the
//! publish timeout), then marks the acknowledged rows published and commits. Ownership moves
//! only between batches. So events of one key reach Kafka in `id` order however many relays
//! run, and a relay that dies (its connection closes) frees its shards at once; its unmarked
//! rows are published again by the next owner (at-least-once).
//!
//! A record the broker refuses for good (too large, unknown or invalid topic, ...) gets an
//! attempt, its error and a retry time on its row; later records of its key wait for it; after
//! `max_attempts` it is parked (`parked_at`), kept for operators and skipped. When Kafka is down
//! nothing is marked: the relay backs off, retries and drains the backlog when it is back.

pub(crate) mod publish;
pub(crate) mod store;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::producer::{FutureProducer, Producer};
use sqlx::postgres::PgListener;
use sqlx::{Executor, PgConnection, PgPool};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config::{self, Backoff};
use crate::error::{Error, Result};
use publish::Outcome;

/// Configures a [`Relay`]. Start with [`Relay::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RelayBuilder {
    pool: PgPool,
    producer: ClientConfig,
    batch_size: usize,
    poll_interval: Duration,
    publish_timeout: Duration,
    max_attempts: u32,
    backoff: Backoff,
}

impl RelayBuilder {
    /// Kafka bootstrap servers (`bootstrap.servers`).
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.producer.set("bootstrap.servers", brokers.into());
        self
    }

    /// Producer settings (security, compression, ...). The relay always uses
    /// `enable.idempotence=true` and `acks=all`: [`build`](Self::build) refuses a configuration
    /// that says otherwise. Settings given here win over the relay's defaults; `brokers` set
    /// before this call is replaced.
    pub fn producer_config(mut self, config: ClientConfig) -> Self {
        for (key, value) in config.config_map() {
            self.producer.set(key, value);
        }
        self
    }

    /// Rows claimed per batch (default 500).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// How often an idle relay looks for work without a notification (default 500 ms).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The longest a batch waits for acknowledgements, and so the longest its transaction stays
    /// open (default 10 s). Also the producer's `message.timeout.ms`.
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// Refusals of a record before it is parked (default 5).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// First wait before retrying a refused record, and after a failed batch; doubles each
    /// time up to `max_backoff` (defaults 1 s and 60 s).
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = Backoff { first, max };
        self
    }

    /// Validates the settings and creates the producer.
    pub fn build(self) -> Result<Relay> {
        let config_err = |msg: String| Err(Error::Config(msg));
        let producer = self.producer;
        config::check_common(
            producer.get("bootstrap.servers"),
            self.batch_size,
            self.poll_interval,
            self.max_attempts,
            self.backoff,
        )?;
        if self.publish_timeout < Duration::from_millis(100) {
            return config_err(format!(
                "publish_timeout must be at least 100 ms, not {:?}",
                self.publish_timeout
            ));
        }
        let producer = create_producer(producer, self.publish_timeout)?;
        Ok(Relay {
            inner: Arc::new(Inner {
                pool: self.pool,
                producer: Some(producer),
                batch_size: self.batch_size,
                poll_interval: self.poll_interval,
                publish_timeout: self.publish_timeout,
                max_attempts: self.max_attempts.min(i32::MAX as u32) as i32,
                backoff: self.backoff,
            }),
        })
    }
}

/// Creates the idempotent producer the relay and replays publish with: `enable.idempotence=true`
/// and `acks=all` (a configuration that says otherwise is refused), `message.timeout.ms` = the
/// publish timeout and `linger.ms=0` unless set.
pub(crate) fn create_producer(
    mut producer: ClientConfig,
    publish_timeout: Duration,
) -> Result<FutureProducer> {
    let config_err = |msg: String| Err(Error::Config(msg));
    match producer.get("enable.idempotence") {
        None => {
            producer.set("enable.idempotence", "true");
        }
        Some("true") => {}
        Some(other) => {
            return config_err(format!(
                "the outbox's producer (relay, replay) must be idempotent (R-DIST-IDEM-X2): \
                 enable.idempotence={other} is not allowed"
            ))
        }
    }
    match producer
        .get("acks")
        .or(producer.get("request.required.acks"))
    {
        None => {
            producer.set("acks", "all");
        }
        Some("all" | "-1") => {}
        Some(other) => {
            return config_err(format!(
                "the outbox's producer (relay, replay) must wait for all in-sync replicas: acks={other} \
                 is not allowed (use acks=all)"
            ))
        }
    }
    let timeout_ms = publish_timeout.as_millis().to_string();
    if producer.get("message.timeout.ms").is_none() {
        producer.set("message.timeout.ms", &timeout_ms);
    }
    if producer.get("linger.ms").is_none() {
        producer.set("linger.ms", "0");
    }
    producer
        .create()
        .map_err(|e| Error::Config(format!("cannot create the Kafka producer: {e}")))
}

/// Publishes the outbox to Kafka. Cheap to clone; every [`run`](Self::run) or
/// [`spawn`](Self::spawn) is one more instance sharing the producer. See the
/// [module documentation](self) for how it works.
#[derive(Clone)]
pub struct Relay {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    /// `None` only in [`drain_without_kafka`], which measures the database side alone.
    producer: Option<FutureProducer>,
    batch_size: usize,
    poll_interval: Duration,
    publish_timeout: Duration,
    max_attempts: i32,
    backoff: Backoff,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("batch_size", &self.inner.batch_size)
            .field("poll_interval", &self.inner.poll_interval)
            .field("publish_timeout", &self.inner.publish_timeout)
            .field("max_attempts", &self.inner.max_attempts)
            .finish_non_exhaustive()
    }
}

/// Backlog figures: see [`Relay::status`] and [`status`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStatus {
    /// Rows waiting to be published (not parked).
    pub unpublished: i64,
    /// Of those, rows the broker refused that wait for a retry.
    pub retrying: i64,
    /// Parked rows (refused `max_attempts` times; kept, skipped).
    pub parked: i64,
    /// Age of the oldest row waiting to be published.
    pub oldest_unpublished_age: Option<Duration>,
}

/// The relay's backlog figures, from the database alone.
pub async fn status(pool: &PgPool) -> Result<RelayStatus> {
    let (unpublished, retrying, parked, age): (i64, i64, i64, Option<f64>) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE parked_at IS NULL), \
                count(*) FILTER (WHERE parked_at IS NULL AND next_attempt_at IS NOT NULL), \
                count(*) FILTER (WHERE parked_at IS NOT NULL), \
                extract(epoch FROM now() - min(created_at) FILTER (WHERE parked_at IS NULL))::float8 \
         FROM outbox_event WHERE published_at IS NULL",
    )
    .fetch_one(pool)
    .await?;
    Ok(RelayStatus {
        unpublished,
        retrying,
        parked,
        oldest_unpublished_age: age.map(|s| Duration::from_secs_f64(s.max(0.0))),
    })
}

impl Relay {
    /// A builder with the defaults; set at least [`brokers`](RelayBuilder::brokers).
    pub fn builder(pool: PgPool) -> RelayBuilder {
        RelayBuilder {
            pool,
            producer: ClientConfig::new(),
            batch_size: 500,
            poll_interval: Duration::from_millis(500),
            publish_timeout: Duration::from_secs(10),
            max_attempts: 5,
            backoff: Backoff {
                first: Duration::from_secs(1),
                max: Duration::from_secs(60),
            },
        }
    }

    /// Runs one relay instance on a tokio task until `cancel` fires; see [`run`](Self::run).
    pub fn spawn(&self, cancel: CancellationToken) -> JoinHandle<Result<()>> {
        let relay = self.clone();
        tokio::spawn(async move { relay.run(cancel).await })
    }

    /// Runs one relay instance until `cancel` fires: publishes as events commit (woken by
    /// NOTIFY, and polling every `poll_interval`), retries with backoff on errors. On cancel it
    /// finishes the batch in flight (bounded by the publish timeout), flushes the producer and
    /// returns. Errors are logged and retried, never returned, except at cancellation.
    pub async fn run(&self, cancel: CancellationToken) -> Result<()> {
        let mut instance = Instance::new(&self.inner);
        let mut listener: Option<PgListener> = None;
        let mut failures = 0u32;
        let mut gauges_at: Option<Instant> = None;
        while !cancel.is_cancelled() {
            if listener.is_none() {
                listener = listen(&self.inner.pool).await;
            }
            if gauges_at.is_none_or(|t| t.elapsed() >= GAUGES_EVERY) {
                gauges_at = Some(Instant::now());
                report_backlog(&self.inner.pool).await;
            }
            match instance.step().await {
                Ok(Step::Full) => {
                    failures = 0;
                    // Busy: emitters need not notify (NOTIFY serializes their commits).
                    if let Err(e) = instance.set_waiting(false).await {
                        tracing::warn!(error = %e, "outbox relay could not clear its waiting mark");
                        instance.reset();
                    }
                    continue;
                }
                Ok(Step::Idle) => {
                    failures = 0;
                    // About to wait: ask emitters to notify, then look once more, for rows
                    // committed before they could see the mark.
                    if !instance.waiting && !instance.shards.is_empty() {
                        match instance.set_waiting(true).await {
                            Ok(()) => continue,
                            Err(e) => {
                                tracing::warn!(error = %e, "outbox relay could not mark itself waiting");
                                instance.reset();
                            }
                        }
                    }
                    // Without shards, look again soon: another instance is about to free some.
                    let wait = if instance.shards.is_empty() {
                        self.inner.poll_interval.min(REBALANCE_EVERY)
                    } else {
                        self.inner.poll_interval
                    };
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        () = tokio::time::sleep(wait) => {}
                        notified = wait_notification(&mut listener) => {
                            if !notified {
                                listener = None;
                            }
                        }
                    }
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let backoff = self.inner.backoff(failures);
                    tracing::warn!(error = %e, ?backoff, "outbox relay batch failed; retrying");
                    metrics::counter!("outbox_relay_batch_failures_total").increment(1);
                    instance.reset();
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        () = tokio::time::sleep(backoff) => {}
                    }
                }
            }
        }
        if let Err(e) = instance.set_waiting(false).await {
            tracing::debug!(error = %e, "outbox relay could not clear its waiting mark on shutdown");
        }
        let Some(producer) = self.inner.producer.clone() else {
            return Ok(());
        };
        let timeout = self.inner.publish_timeout;
        tokio::task::spawn_blocking(move || producer.flush(timeout))
            .await
            .map_err(|e| Error::Config(format!("producer flush task failed: {e}")))?
            .map_err(Error::Kafka)?;
        Ok(())
    }

    /// Publishes everything unpublished that this instance can own, once, and returns how many
    /// rows it published. For tests, scripts and benchmarks; a failed batch is an error.
    pub async fn publish_pending(&self) -> Result<u64> {
        let mut instance = Instance::new(&self.inner);
        let before = instance.published;
        while let Step::Full = instance.step().await? {}
        Ok(instance.published - before)
    }

    /// The backlog figures; the same as [`status`].
    pub async fn status(&self) -> Result<RelayStatus> {
        status(&self.inner.pool).await
    }
}

/// Runs the relay's database work alone (claim, mark, commit; every row counts as
/// acknowledged, nothing is sent) until nothing is left, and returns how many rows it marked.
/// For the benchmark that measures the database's share of the relay's cost.
#[doc(hidden)]
pub async fn drain_without_kafka(pool: PgPool, batch_size: usize) -> Result<u64> {
    let builder = Relay::builder(pool);
    let relay = Relay {
        inner: Arc::new(Inner {
            pool: builder.pool,
            producer: None,
            batch_size,
            poll_interval: builder.poll_interval,
            publish_timeout: builder.publish_timeout,
            max_attempts: 5,
            backoff: builder.backoff,
        }),
    };
    relay.publish_pending().await
}

impl Inner {
    fn backoff(&self, failures: u32) -> Duration {
        self.backoff.delay(failures)
    }
}

async fn listen(pool: &PgPool) -> Option<PgListener> {
    let mut listener = PgListener::connect_with(pool).await.ok()?;
    listener.listen("outbox_event").await.ok()?;
    Some(listener)
}

/// Waits for a notification; `false` if the listener broke (the caller reconnects it later).
async fn wait_notification(listener: &mut Option<PgListener>) -> bool {
    match listener {
        Some(l) => l.recv().await.is_ok(),
        None => std::future::pending().await,
    }
}

/// How often a running relay reports the backlog gauges.
const GAUGES_EVERY: Duration = Duration::from_secs(10);

/// Sets `outbox_relay_backlog`, `outbox_relay_parked` and
/// `outbox_relay_oldest_unpublished_age_seconds` from [`status`].
async fn report_backlog(pool: &PgPool) {
    match status(pool).await {
        Ok(s) => {
            metrics::gauge!("outbox_relay_backlog").set(s.unpublished as f64);
            metrics::gauge!("outbox_relay_parked").set(s.parked as f64);
            metrics::gauge!("outbox_relay_oldest_unpublished_age_seconds")
                .set(s.oldest_unpublished_age.map_or(0.0, |a| a.as_secs_f64()));
        }
        Err(e) => tracing::debug!(error = %e, "cannot read the outbox backlog"),
    }
}

/// How often an instance checks its share of the shards (when busy; an idle one checks each
/// time it wakes).
const REBALANCE_EVERY: Duration = Duration::from_millis(100);

enum Step {
    /// A full batch was published: there is probably more.
    Full,
    /// Less than a full batch: wait for work.
    Idle,
}

/// One relay instance's state: its connection, member slot and owned shards.
struct Instance<'r> {
    relay: &'r Inner,
    conn: Option<PgConnection>,
    slot: i32,
    shards: BTreeSet<i32>,
    last_rebalance: Option<Instant>,
    published: u64,
    /// Whether this instance's waiting mark is set.
    waiting: bool,
}

impl<'r> Instance<'r> {
    fn new(relay: &'r Inner) -> Self {
        Instance {
            relay,
            conn: None,
            slot: 0,
            shards: BTreeSet::new(),
            last_rebalance: None,
            published: 0,
            waiting: false,
        }
    }

    async fn set_waiting(&mut self, waiting: bool) -> Result<()> {
        if self.waiting == waiting {
            return Ok(());
        }
        let slot = self.slot;
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        store::set_waiting(conn, slot, waiting).await?;
        self.waiting = waiting;
        Ok(())
    }

    /// Drops the connection: the server releases its shards and any open transaction.
    fn reset(&mut self) {
        // A mark left behind is cleared by the next instance that joins.
        self.waiting = false;
        self.conn = None;
        self.shards.clear();
        self.last_rebalance = None;
    }

    /// Connects, joins the members and clears stale waiting marks, unless connected already.
    async fn connect(&mut self) -> Result<()> {
        if self.conn.is_none() {
            let mut conn = self.relay.pool.acquire().await?.detach();
            // A relay that hangs must not hold its rows forever.
            let guard = self.relay.publish_timeout + Duration::from_secs(30);
            conn.execute(
                format!(
                    "SET idle_in_transaction_session_timeout = {}; \
                     SET application_name = 'outbox-relay'",
                    guard.as_millis()
                )
                .as_str(),
            )
            .await?;
            self.slot = store::join(&mut conn).await?.ok_or_else(|| {
                Error::Config("no free relay member slot (more than 4096 relays?)".into())
            })?;
            store::clear_stale_waiting(&mut conn, self.slot).await?;
            self.conn = Some(conn);
        }
        Ok(())
    }

    /// Rebalances shards when due, then publishes one batch.
    async fn step(&mut self) -> Result<Step> {
        let due = self
            .last_rebalance
            .is_none_or(|t| t.elapsed() >= REBALANCE_EVERY);
        if due {
            self.connect().await?;
            let conn = self.conn.as_mut().expect("connected above");
            store::rebalance(conn, &mut self.shards, self.slot).await?;
            self.last_rebalance = Some(Instant::now());
        }
        if self.shards.is_empty() {
            return Ok(Step::Idle);
        }
        let span = tracing::info_span!(
            "outbox_relay_batch",
            claimed = tracing::field::Empty,
            published = tracing::field::Empty,
            shards = self.shards.len()
        );
        // On an error the caller drops the connection (`reset`), which ends the transaction.
        self.batch().instrument(span).await
    }

    async fn batch(&mut self) -> Result<Step> {
        let relay = self.relay;
        let limit = relay.batch_size as i64;
        let conn = self.conn.as_mut().expect("connected in step");
        let rows = store::claim(conn, &self.shards, limit).await?;
        tracing::Span::current().record("claimed", rows.len());
        if rows.is_empty() {
            store::abandon(conn).await?;
            return Ok(Step::Idle);
        }
        let started = Instant::now();
        let outcomes = match &relay.producer {
            Some(producer) => publish::publish(producer, &rows, relay.publish_timeout).await,
            None => rows.iter().map(|_| Outcome::Published).collect(),
        };
        let mut published = Vec::with_capacity(rows.len());
        let mut failed = Vec::new();
        let mut deferred: Option<String> = None;
        for (row, outcome) in rows.iter().zip(outcomes) {
            match outcome {
                Outcome::Published => published.push(row.id),
                Outcome::Rejected(error) => {
                    let attempt = u32::try_from(row.attempts).unwrap_or(0) + 1;
                    tracing::warn!(id = row.id, event_id = %row.event_id, topic = %row.topic,
                        attempt, %error, "broker refused an outbox record");
                    failed.push(store::Failure {
                        id: row.id,
                        error,
                        backoff_secs: relay.backoff(attempt).as_secs_f64(),
                    });
                }
                Outcome::Deferred(error) => {
                    deferred.get_or_insert(error);
                }
                // Its key waits for the refused record (now retrying), then goes on.
                Outcome::Skipped => {}
            }
        }
        let parked = store::finish(conn, &published, &failed, relay.max_attempts).await?;
        let n = published.len() as u64;
        self.published += n;
        tracing::Span::current().record("published", n);
        metrics::counter!("outbox_relay_published_total").increment(n);
        metrics::counter!("outbox_relay_failed_total").increment(failed.len() as u64);
        metrics::counter!("outbox_relay_parked_total").increment(parked);
        metrics::histogram!("outbox_relay_publish_seconds").record(started.elapsed().as_secs_f64());
        if parked > 0 {
            tracing::error!(parked, "outbox records parked after repeated refusals");
        }
        if let Some(error) = deferred {
            // The broker is unreachable or slow: back off like any failed batch.
            return Err(Error::Publish(error));
        }
        Ok(if rows.len() as i64 >= limit {
            Step::Full
        } else {
            Step::Idle
        })
    }
}

/// Test shim: the old claim, explained.
#[doc(hidden)]
pub async fn explain_claim(pool: &PgPool, _cursor: i64, limit: i64) -> Result<serde_json::Value> {
    let mut conn = pool.acquire().await?;
    conn.execute("BEGIN").await?;
    let shards: Vec<i32> = (0..64).collect();
    let sql = format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}",
        store::CLAIM_SQL
    );
    let plan: serde_json::Value = sqlx::query_scalar(&sql)
        .bind(&shards)
        .bind(limit)
        .fetch_one(&mut *conn)
        .await?;
    conn.execute("ROLLBACK").await?;
    Ok(plan)
}
