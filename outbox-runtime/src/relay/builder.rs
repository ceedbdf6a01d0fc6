//! The relay's configuration, its producer, and the run loop of an instance.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::producer::{FutureProducer, Producer};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::cloudevents::CloudEvents;
use super::instance::{Instance, Step};
use super::publish::PerKey;
use super::wakeup::Wakeups;
use super::{status, RelayStatus};
use crate::config::{self, Backoff};
use crate::error::{Error, Result};

/// Configures a [`Relay`]. Start with [`Relay::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RelayBuilder {
    pool: PgPool,
    producer: ClientConfig,
    batch_size: usize,
    poll_interval: Duration,
    publish_timeout: Duration,
    failover_timeout: Duration,
    max_attempts: u32,
    backoff: Backoff,
    hold_operator_errors: bool,
    per_key: PerKey,
    cloud_events: Option<CloudEvents>,
}

impl RelayBuilder {
    /// Publishes events as CloudEvents (binary content mode: `ce_*` headers), on every topic
    /// or on those [`CloudEvents::topics`] lists; see [`CloudEvents`] for the attributes.
    /// `build` refuses an empty source or topic list.
    pub fn cloud_events(mut self, cloud_events: CloudEvents) -> Self {
        self.cloud_events = Some(cloud_events);
        self
    }

    /// Kafka bootstrap servers (`bootstrap.servers`).
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.producer.set("bootstrap.servers", brokers.into());
        self
    }

    /// Producer settings (security, compression, ...). Settings given here win over the
    /// relay's defaults; `brokers` set before this call is replaced. [`build`](Self::build)
    /// refuses settings that would break the relay's promises: the producer is always
    /// idempotent (`enable.idempotence=true`, `acks=all`), fails rather than leave a gap
    /// (`enable.gapless.guarantee=true`), and never times a message out itself
    /// (`message.timeout.ms=0`: the relay bounds its waits with the publish timeout, and a
    /// message the producer timed out could let a later one of its key overtake it).
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
    /// open (default 10 s). Records not acknowledged by then stay unpublished; the producer
    /// still delivers them if it can (a duplicate, never a reordering).
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// How long a relay that went silent (its host crashed or vanished from the network
    /// without closing its connection) keeps its shards (default 20 s). PostgreSQL ends a relay
    /// session that said nothing for this long (`idle_session_timeout`,
    /// `idle_in_transaction_session_timeout`, TCP keepalives and `tcp_user_timeout` on the
    /// server's side of the connection), which frees its shards for the others; and a relay
    /// gives up on a statement that got no answer for this long. An idle relay looks for work
    /// at least every half of it. Must exceed the publish timeout by a second at least.
    pub fn failover_timeout(mut self, timeout: Duration) -> Self {
        self.failover_timeout = timeout;
        self
    }

    /// Refusals of a record before it is parked (default 5).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// First wait before retrying a refused record, and after a failed batch; doubles each
    /// time up to `max` (defaults 1 s and 60 s). After a failed batch (database or broker
    /// down) the wait is drawn at random below that ("full jitter"), so that relays an outage
    /// stopped together do not retry in lockstep.
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = Backoff { first, max };
        self
    }

    /// Whether a record refused for an operator's reason (its topic does not exist, the relay
    /// may not write to it, authentication failed) holds its key until that is fixed (`true`,
    /// the default: retried every `min(max_backoff, 10 s)`, never parked; `outbox status` and the
    /// `outbox_relay_held` gauge show it), or counts as an attempt like any refusal (`false`:
    /// parked after `max_attempts`, after which the key's later events overtake it).
    pub fn hold_operator_errors(mut self, hold: bool) -> Self {
        self.hold_operator_errors = hold;
        self
    }

    /// Sends a key's next record only once the broker acknowledged the previous one (default
    /// `false`: all of a key's records in a batch go out together).
    ///
    /// Kafka keeps one key's records in order with several in flight, because the idempotent
    /// producer numbers them and the broker refuses what does not follow on from what it wrote:
    /// a record it refuses takes the ones behind it with it. Apache Kafka and Redpanda check;
    /// a broker that does not (librdkafka's mock cluster, some services that speak the Kafka
    /// protocol) can write a key's later record after refusing an earlier one. Turn this on for
    /// such a broker. It costs a broker round trip per record of a key in a batch: a key with
    /// many events in a batch goes out that much slower.
    pub fn one_record_in_flight_per_key(mut self, one: bool) -> Self {
        self.per_key = if one {
            PerKey::OneInFlight
        } else {
            PerKey::Pipelined
        };
        self
    }

    /// Validates the settings and creates the producer.
    pub fn build(self) -> Result<Relay> {
        let config_err = |msg: String| Err(Error::Config(msg));
        config::check_common(
            self.producer.get("bootstrap.servers"),
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
        if self.failover_timeout < self.publish_timeout + Duration::from_secs(1) {
            return config_err(format!(
                "failover_timeout ({:?}) must exceed publish_timeout ({:?}) by at least 1 s: a \
                 relay is silent that long while it waits for acknowledgements",
                self.failover_timeout, self.publish_timeout
            ));
        }
        if let Some(ce) = &self.cloud_events {
            ce.check().map_err(Error::Config)?;
        }
        let producer = ProducerSlot::new(self.producer)?;
        Ok(Relay {
            inner: Arc::new(Inner {
                pool: self.pool,
                producer: Some(producer),
                batch_size: self.batch_size,
                poll_interval: self.poll_interval,
                publish_timeout: self.publish_timeout,
                failover_timeout: self.failover_timeout,
                max_attempts: self.max_attempts.min(i32::MAX as u32) as i32,
                backoff: self.backoff,
                hold_operator_errors: self.hold_operator_errors,
                per_key: self.per_key,
                cloud_events: self.cloud_events,
            }),
        })
    }
}

/// Creates the idempotent producer the relay and replays publish with: `enable.idempotence`,
/// `acks=all`, `enable.gapless.guarantee` and no producer-side message timeout (settings that
/// say otherwise are refused); `linger.ms=0` unless set.
pub(crate) fn create_producer(mut producer: ClientConfig) -> Result<FutureProducer> {
    let config_err = |msg: String| Err(Error::Config(msg));
    let required: [(&[&str], &[&str], &str, &str); 4] = [
        (
            &["enable.idempotence"],
            &["true"],
            "true",
            "the outbox's producer (relay, replay) must be idempotent (R-DIST-IDEM-X2)",
        ),
        (
            &["acks", "request.required.acks"],
            &["all", "-1"],
            "all",
            "the outbox's producer (relay, replay) must wait for all in-sync replicas (use acks=all)",
        ),
        (
            &["enable.gapless.guarantee"],
            &["true"],
            "true",
            "the outbox's producer must fail rather than leave a gap in a key's events",
        ),
        (
            &["message.timeout.ms", "delivery.timeout.ms"],
            &["0"],
            "0",
            "the outbox's producer must not time messages out itself (a timed-out record can be \
             overtaken by a later one of its key); the relay bounds its waits with \
             publish_timeout",
        ),
    ];
    for (keys, allowed, default, why) in required {
        match keys
            .iter()
            .find_map(|k| producer.get(k).map(|v| (*k, v.to_owned())))
        {
            None => {
                producer.set(keys[0], default);
            }
            Some((_, value)) if allowed.contains(&value.as_str()) => {}
            Some((key, value)) => {
                return config_err(format!("{why}: {key}={value} is not allowed"));
            }
        }
    }
    if producer.get("linger.ms").is_none() {
        producer.set("linger.ms", "0");
    }
    // A topic the cluster does not know fails its records after this long (librdkafka's
    // default, 30 s, stalls every batch meanwhile). A topic created moments ago and taken for
    // missing costs nothing: its record is held and tried again.
    if producer.get("topic.metadata.propagation.max.ms").is_none() {
        producer.set("topic.metadata.propagation.max.ms", "1000");
    }
    producer.create().map_err(|source| Error::KafkaClient {
        client: "producer",
        source,
    })
}

/// The producer every instance of a relay shares, replaced when it fails for good.
pub(super) struct ProducerSlot {
    config: ClientConfig,
    current: RwLock<Arc<FutureProducer>>,
}

impl ProducerSlot {
    fn new(config: ClientConfig) -> Result<ProducerSlot> {
        let producer = create_producer(config.clone())?;
        Ok(ProducerSlot {
            config,
            current: RwLock::new(Arc::new(producer)),
        })
    }

    pub(super) fn get(&self) -> Arc<FutureProducer> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// If `used` (the producer a batch used) has a fatal error, replaces it with a new one,
    /// unless another instance did already. Its unacknowledged records were failed by the fatal
    /// error; the rows stay unpublished and are sent again on the new producer.
    pub(super) fn recover(&self, used: &Arc<FutureProducer>) {
        let Some((code, reason)) = used.client().fatal_error() else {
            return;
        };
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        if !Arc::ptr_eq(&current, used) {
            return;
        }
        match create_producer(self.config.clone()) {
            Ok(producer) => {
                tracing::error!(error = ?code, %reason,
                    "the outbox relay's Kafka producer failed for good; replaced it with a new one");
                metrics::counter!("outbox_relay_producer_recreated_total").increment(1);
                *current = Arc::new(producer);
            }
            Err(e) => tracing::error!(error = %crate::error_chain(&e), fatal = %reason,
                "the outbox relay's Kafka producer failed for good and cannot be replaced"),
        }
    }
}

/// Publishes the outbox to Kafka. Cheap to clone; every [`run`](Self::run) or
/// [`spawn`](Self::spawn) is one more instance sharing the producer. See the
/// [module documentation](super) for how it works.
#[derive(Clone)]
pub struct Relay {
    inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) pool: PgPool,
    /// `None` only in [`drain_without_kafka`], which measures the database side alone.
    pub(super) producer: Option<ProducerSlot>,
    pub(super) batch_size: usize,
    pub(super) poll_interval: Duration,
    pub(super) publish_timeout: Duration,
    pub(super) failover_timeout: Duration,
    pub(super) max_attempts: i32,
    pub(super) backoff: Backoff,
    pub(super) hold_operator_errors: bool,
    pub(super) per_key: PerKey,
    pub(super) cloud_events: Option<CloudEvents>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("batch_size", &self.inner.batch_size)
            .field("poll_interval", &self.inner.poll_interval)
            .field("publish_timeout", &self.inner.publish_timeout)
            .field("failover_timeout", &self.inner.failover_timeout)
            .field("max_attempts", &self.inner.max_attempts)
            .finish_non_exhaustive()
    }
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
            failover_timeout: Duration::from_secs(20),
            max_attempts: 5,
            backoff: Backoff {
                first: Duration::from_secs(1),
                max: Duration::from_secs(60),
            },
            hold_operator_errors: true,
            per_key: PerKey::Pipelined,
            cloud_events: None,
        }
    }

    /// Runs one relay instance on a tokio task until `cancel` fires; see [`run`](Self::run).
    pub fn spawn(&self, cancel: CancellationToken) -> JoinHandle<Result<()>> {
        let relay = self.clone();
        tokio::spawn(async move { relay.run(cancel).await })
    }

    /// Runs one relay instance until `cancel` fires: publishes as events commit (claiming
    /// again at once while claims find rows; once one finds nothing, woken by NOTIFY, and
    /// polling every `poll_interval`), retries with backoff on errors (a lost
    /// database or broker, a producer that failed for good). On cancel it finishes the batch in
    /// flight (bounded by the publish timeout) and returns. Errors are logged and retried, never
    /// returned.
    pub async fn run(&self, cancel: CancellationToken) -> Result<()> {
        let inner = &self.inner;
        let mut instance = Instance::new(inner);
        let mut wakeups = Wakeups::start(&inner.pool, inner.failover_timeout, inner.backoff);
        let mut failures = 0u32;
        // Whether the last claim found rows.
        let mut found_rows = false;
        let mut gauges_at: Option<Instant> = None;
        // What the pool is asked for besides the instance's own connection must not stall the
        // loop while the database is away: a lost gauge costs nothing.
        let aside = inner.poll_interval.max(Duration::from_secs(1));
        while !cancel.is_cancelled() {
            if gauges_at.is_none_or(|t| t.elapsed() >= GAUGES_EVERY) {
                gauges_at = Some(Instant::now());
                let _ = tokio::time::timeout(aside, report_backlog(&inner.pool)).await;
            }
            // Notifications from here on may be of rows this step's claim does not see.
            wakeups.mark_seen();
            match instance.step().await {
                Ok(step @ (Step::Full | Step::Partial)) => {
                    failures = 0;
                    // Events are coming: claim again at once. Once they keep coming (a full
                    // batch, or rows found twice in a row), emitters need not notify: a
                    // notifying commit takes a database-wide lock that serializes them.
                    if step == Step::Full || found_rows {
                        if let Err(e) = instance.set_waiting(false).await {
                            tracing::warn!(error = %crate::error_chain(&e), "outbox relay could not clear its waiting mark");
                            instance.reset();
                        }
                    }
                    found_rows = true;
                    continue;
                }
                Ok(Step::Empty) => {
                    failures = 0;
                    found_rows = false;
                    // About to wait: ask emitters to notify, then look once more, for rows
                    // committed before they could see the mark.
                    if !instance.waiting() && instance.owns_shards() {
                        match instance.set_waiting(true).await {
                            Ok(()) => continue,
                            Err(e) => {
                                tracing::warn!(error = %crate::error_chain(&e), "outbox relay could not mark itself waiting");
                                instance.reset();
                            }
                        }
                    }
                    // Without shards, look again soon: another instance is about to free some.
                    // With them, soon enough that the server does not take the session for a
                    // dead one.
                    let wait = if instance.owns_shards() {
                        inner.poll_interval.min(inner.failover_timeout / 2)
                    } else {
                        inner.poll_interval.min(REBALANCE_EVERY)
                    };
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        () = tokio::time::sleep(wait) => {}
                        () = wakeups.notified() => {}
                    }
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    found_rows = false;
                    let backoff = inner.backoff.jittered(failures);
                    tracing::warn!(error = %crate::error_chain(&e), ?backoff, "outbox relay batch failed; retrying");
                    metrics::counter!("outbox_relay_batch_failures_total").increment(1);
                    instance.reset();
                    if matches!(e, Error::Database(_)) && e.is_transient() {
                        // A lost connection: the listener's is probably gone too.
                        wakeups.reconnect();
                    }
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        () = tokio::time::sleep(backoff) => {}
                    }
                }
            }
        }
        if let Err(e) = instance.set_waiting(false).await {
            tracing::debug!(error = %crate::error_chain(&e), "outbox relay could not clear its waiting mark on shutdown");
        }
        // Every batch waited for its own acknowledgements: nothing to flush. Records a timed-out
        // batch left with the producer stay unpublished in the outbox; whoever publishes them
        // next sends them again.
        Ok(())
    }

    /// Publishes everything unpublished that this instance can own, once, and returns how many
    /// rows it published. For tests, scripts and benchmarks; a failed batch is an error.
    pub async fn publish_pending(&self) -> Result<u64> {
        let mut instance = Instance::new(&self.inner);
        while let Step::Full = instance.step().await? {}
        Ok(instance.published())
    }

    /// The backlog figures; the same as [`status`](super::status).
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
            failover_timeout: builder.failover_timeout,
            max_attempts: 5,
            backoff: builder.backoff,
            hold_operator_errors: true,
            per_key: PerKey::Pipelined,
            cloud_events: None,
        }),
    };
    relay.publish_pending().await
}

/// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` of one claim of `limit` rows of every shard after
/// `cursor`, on a connection set up as a relay's (and rolled back). For the tests that check a
/// claim's cost does not grow with the backlog.
#[doc(hidden)]
pub async fn explain_claim(pool: &PgPool, cursor: i64, limit: i64) -> Result<serde_json::Value> {
    let relay = Relay::builder(pool.clone()).brokers("unused:9092");
    let inner = Inner {
        pool: relay.pool,
        producer: None,
        batch_size: limit as usize,
        poll_interval: relay.poll_interval,
        publish_timeout: relay.publish_timeout,
        failover_timeout: relay.failover_timeout,
        max_attempts: 5,
        backoff: relay.backoff,
        hold_operator_errors: true,
        per_key: PerKey::Pipelined,
        cloud_events: None,
    };
    Instance::new(&inner).explain_claim(cursor).await
}

/// How often a running relay reports the backlog gauges.
const GAUGES_EVERY: Duration = Duration::from_secs(10);

/// Sets `outbox_relay_backlog`, `outbox_relay_held`, `outbox_relay_parked` and
/// `outbox_relay_oldest_unpublished_age_seconds` from [`status`].
async fn report_backlog(pool: &PgPool) {
    match status(pool).await {
        Ok(s) => {
            metrics::gauge!("outbox_relay_backlog").set(s.unpublished as f64);
            metrics::gauge!("outbox_relay_held").set(s.held as f64);
            metrics::gauge!("outbox_relay_parked").set(s.parked as f64);
            metrics::gauge!("outbox_relay_oldest_unpublished_age_seconds")
                .set(s.oldest_unpublished_age.map_or(0.0, |a| a.as_secs_f64()));
        }
        Err(e) => {
            tracing::debug!(error = %crate::error_chain(&e), "cannot read the outbox backlog")
        }
    }
}

/// How often an instance checks its share of the shards (when busy; an idle one checks each
/// time it wakes).
pub(super) const REBALANCE_EVERY: Duration = Duration::from_millis(100);
