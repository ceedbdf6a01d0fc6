//! The Kafka consumer: dedup mode, inbox receipt and processors.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::producer::FutureProducer;
use rdkafka::{ClientConfig, TopicPartitionList};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::dedup::{self, Checked};
use super::forward::{self, Destination, Forward};
use super::handler::{Failure, Handler, Routes, Upcasters};
use super::message;
use super::store::{self, inbox_status, InboxStatus};
use crate::config::{self, Backoff};
use crate::error::{Error, Result};

/// How a consumer hands messages to its handlers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Mode {
    /// Handle each message at once, deduplicated through `processed_event`.
    #[default]
    Dedup,
    /// Store messages in `inbox_event` first; processor tasks handle them at their own pace.
    Inbox,
}

/// What a dedup-mode consumer does with a message whose handler failed retryably.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RetryPolicy {
    /// Send it to its retry topic (`<topic>.retry`), store its offset and go on: its
    /// partition flows on, and the consumer (which also reads the retry topic) tries it again
    /// once its backoff has passed; after `max_attempts`, its dead-letter topic. A retried
    /// message is handled after its key's later messages. The style guide's choice for
    /// ordinary consumers (R-DIST-OBX-2).
    #[default]
    Topic,
    /// Retry it where it is, with backoff, before anything after it in the consumer's batch:
    /// strict per-key order, but a failing message holds up every partition of the consumer
    /// meanwhile. For flows whose handlers need one key's events in order.
    InPlace,
}

/// Configures a [`Consumer`]. Start with [`Consumer::builder`].
///
/// `S` is the application state its handlers are called with ([`state`](Self::state)); `()`
/// until one is set.
#[must_use]
pub struct ConsumerBuilder<S = ()> {
    state: Arc<S>,
    routes: Routes,
    errors: Vec<String>,
    settings: Settings,
}

/// A builder's settings: all of it but the state and the handlers, so that
/// [`ConsumerBuilder::state`] moves them over as one.
struct Settings {
    pool: PgPool,
    config: ClientConfig,
    producer_config: ClientConfig,
    mode: Mode,
    max_attempts: u32,
    backoff: Backoff,
    dlq_suffix: String,
    retry_policy: RetryPolicy,
    retry_suffix: String,
    retry_tiers: u32,
    processors: usize,
    batch_size: usize,
    poll_interval: Duration,
    upcasters: Upcasters,
}

impl<S> std::fmt::Debug for ConsumerBuilder<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("state", &std::any::type_name::<S>())
            .field("mode", &self.settings.mode)
            .field("topics", &self.routes.topics())
            .finish_non_exhaustive()
    }
}

impl ConsumerBuilder<()> {
    /// The application state handlers are called with: an HTTP client, configuration, a
    /// cache. A handler takes it as a `state: &T` parameter (`#[inbox_handler]`), or as the
    /// `state` argument of [`Handler::handle`]. Set it before registering the handlers that
    /// take it: a handler whose state type is not `T` is a compile error, not a runtime
    /// failure. Handlers without state work with any.
    ///
    /// The consumer holds it in an [`Arc`] shared by every handler and processor; put what
    /// changes behind a lock, or hold `Arc`s inside it. One state per consumer: for several
    /// parts, make it a struct of them.
    ///
    /// ```
    /// # #[derive(serde::Serialize, serde::Deserialize, outbox_runtime::OutboxEvent)]
    /// # #[outbox(topic = "order.events", aggregate_type = "Order")]
    /// # struct OrderCreated { #[outbox(aggregate_id)] order_id: uuid::Uuid, amount: i64 }
    /// use outbox_runtime::inbox::{Consumer, HandlerError, MessageMeta};
    /// use outbox_runtime::inbox_handler;
    /// use sqlx::PgConnection;
    ///
    /// struct Payments {
    ///     provider_url: String,
    /// }
    ///
    /// #[inbox_handler]
    /// async fn charge(
    ///     event: OrderCreated,
    ///     tx: &mut PgConnection,
    ///     payments: &Payments,
    ///     meta: &MessageMeta<'_>,
    /// ) -> Result<(), HandlerError> {
    ///     tracing::info!(url = %payments.provider_url, attempt = meta.attempt(), "charging");
    ///     # let _ = (event, tx);
    ///     Ok(())
    /// }
    ///
    /// # fn build(pool: sqlx::PgPool) -> outbox_runtime::Result<()> {
    /// let consumer = Consumer::builder(pool)
    ///     .brokers("localhost:9092")
    ///     .group_id("payments")
    ///     .state(Payments { provider_url: "https://pay.example".into() })
    ///     .handler(charge)
    ///     .build()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn state<T: Send + Sync + 'static>(self, state: T) -> ConsumerBuilder<T> {
        ConsumerBuilder {
            state: Arc::new(state),
            routes: self.routes,
            errors: self.errors,
            settings: self.settings,
        }
    }
}

impl<S: Send + Sync + 'static> ConsumerBuilder<S> {
    /// Kafka bootstrap servers.
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.settings
            .config
            .set("bootstrap.servers", brokers.into());
        self
    }

    /// The consumer group (required).
    pub fn group_id(mut self, group: impl Into<String>) -> Self {
        self.settings.config.set("group.id", group.into());
        self
    }

    /// Consumer settings (security, ...); they win over the defaults. The consumer always
    /// stores offsets itself (`enable.auto.offset.store=false`): `build` refuses `true`.
    pub fn consumer_config(mut self, config: ClientConfig) -> Self {
        for (key, value) in config.config_map() {
            self.settings.config.set(key, value);
        }
        self
    }

    /// Settings of the producer that sends messages to retry and dead-letter topics (by
    /// default: the consumer's `bootstrap.servers` and its `security.*`, `sasl.*` and `ssl.*`
    /// settings); they win over the defaults, except idempotence and `acks=all`, which it
    /// always uses.
    pub fn producer_config(mut self, config: ClientConfig) -> Self {
        for (key, value) in config.config_map() {
            self.settings.producer_config.set(key, value);
        }
        self
    }

    /// Registers a handler (see `#[inbox_handler]`). Messages are routed by their topic and
    /// `event_type` header to every handler of that event type. Handlers of one event need
    /// different [names](Handler::name); `build` refuses a name registered twice.
    pub fn handler<H: Handler<S>>(mut self, handler: H) -> Self {
        if let Err(e) = self.routes.add(handler, Arc::clone(&self.state)) {
            self.errors.push(e);
        }
        self
    }

    /// Registers an upcaster: a message of event `E` sent with schema version `from` that a
    /// handler of `E` does not accept ([`Handler::accepts_version`]) is made into an `E` by
    /// `upcast`, from its payload as JSON, and handed to that handler. Its error is permanent:
    /// the message goes to the dead letters with it. `from` is usually an older version; one
    /// upcaster per version (several versions: one each). The handler's
    /// [`MessageMeta::schema_version`](super::MessageMeta::schema_version) stays the version
    /// sent.
    ///
    /// `build` refuses version 0, `E`'s own version, two upcasters for one version, an
    /// upcaster for an event no handler takes, and one from a version every handler of `E`
    /// takes as it is (declared in its `versions`).
    ///
    /// ```
    /// # use outbox_runtime::inbox::{Consumer, HandlerError};
    /// # use sqlx::PgConnection;
    /// /// Version 2 split `name` into two fields.
    /// #[derive(serde::Serialize, serde::Deserialize, outbox_runtime::OutboxEvent)]
    /// #[outbox(topic = "customer.events", aggregate_type = "Customer", version = 2)]
    /// struct CustomerRenamed {
    ///     #[outbox(aggregate_id)]
    ///     customer_id: uuid::Uuid,
    ///     first_name: String,
    ///     last_name: String,
    /// }
    ///
    /// #[outbox_runtime::inbox_handler]
    /// async fn rename(event: CustomerRenamed, tx: &mut PgConnection) -> Result<(), HandlerError> {
    ///     # let _ = (event, tx);
    ///     Ok(())
    /// }
    ///
    /// # fn build(pool: sqlx::PgPool) -> outbox_runtime::Result<()> {
    /// let consumer = Consumer::builder(pool)
    ///     .brokers("localhost:9092")
    ///     .group_id("crm")
    ///     .handler(rename)
    ///     .upcast::<CustomerRenamed, _>(1, |v1: serde_json::Value| {
    ///         let name = v1["name"].as_str().ok_or("version 1 has no `name`")?;
    ///         let (first, last) = name.split_once(' ').unwrap_or((name, ""));
    ///         Ok(CustomerRenamed {
    ///             customer_id: serde_json::from_value(v1["customer_id"].clone())?,
    ///             first_name: first.into(),
    ///             last_name: last.into(),
    ///         })
    ///     })
    ///     .build()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn upcast<E, F>(mut self, from: u32, upcast: F) -> Self
    where
        E: crate::OutboxEvent + 'static,
        F: Fn(serde_json::Value) -> std::result::Result<E, crate::inbox::BoxError>
            + Send
            + Sync
            + 'static,
    {
        if let Err(e) = self.settings.upcasters.add::<E>(from, Box::new(upcast)) {
            self.errors.push(e);
        }
        self
    }

    /// [`Mode::Dedup`] (default) or [`Mode::Inbox`].
    pub fn mode(mut self, mode: Mode) -> Self {
        self.settings.mode = mode;
        self
    }

    /// Attempts at a message whose handler fails retryably before it is dead-lettered
    /// (default 5).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.settings.max_attempts = attempts;
        self
    }

    /// Wait before a message's retry, doubling up to `max` (defaults 200 ms and 30 s). While
    /// the database or a retry/dead-letter topic is unreachable, the consumer waits a random
    /// time below the same schedule ("full jitter"), so that consumers an outage stopped
    /// together do not retry in lockstep.
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.settings.backoff = Backoff { first, max };
        self
    }

    /// Dead-letter topic of topic `t`: `t` + this suffix (default `.dlq`).
    pub fn dlq_suffix(mut self, suffix: impl Into<String>) -> Self {
        self.settings.dlq_suffix = suffix.into();
        self
    }

    /// Dedup mode: [`RetryPolicy::Topic`] (default) or [`RetryPolicy::InPlace`]. Inbox mode
    /// retries in its table and ignores this.
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.settings.retry_policy = policy;
        self
    }

    /// Retry topic of topic `t`: `t` + this suffix (default `.retry`).
    pub fn retry_suffix(mut self, suffix: impl Into<String>) -> Self {
        self.settings.retry_suffix = suffix.into();
        self
    }

    /// Retry topics per topic (default 1). With one, a message waiting in the retry topic
    /// holds up the retry partition's later messages until it is due (at most the longest
    /// backoff). With `n` tiers, a message's `k`-th failure sends it to
    /// `<topic><suffix>-<min(k, n)>`, so that messages in one retry topic wait about as long
    /// as each other.
    pub fn retry_tiers(mut self, tiers: u32) -> Self {
        self.settings.retry_tiers = tiers;
        self
    }

    /// Inbox processor tasks this consumer runs (default 1; 0 runs none, for a deployment
    /// whose processors run elsewhere).
    pub fn processors(mut self, processors: usize) -> Self {
        self.settings.processors = processors;
        self
    }

    /// Messages stored per inbox insert, and rows claimed per processor batch (default 500).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.settings.batch_size = batch_size;
        self
    }

    /// How often an idle inbox processor looks for rows (default 200 ms).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval;
        self
    }

    /// Validates the settings and creates the dead-letter producer.
    pub fn build(self) -> Result<Consumer> {
        let fail = |msg: String| Err(Error::Config(msg));
        if let Some(e) = self.errors.first() {
            return fail(e.clone());
        }
        if self.routes.is_empty() {
            return fail("no handlers: register at least one with `handler(...)`".into());
        }
        let mut config = self.settings.config;
        config::check_common(
            config.get("bootstrap.servers"),
            self.settings.batch_size,
            self.settings.poll_interval,
            self.settings.max_attempts,
            self.settings.backoff,
        )?;
        if config.get("group.id").is_none_or(str::is_empty) {
            return fail("no consumer group: call `group_id(...)`".into());
        }
        if config
            .get("enable.auto.offset.store")
            .is_some_and(|v| v != "false")
        {
            return fail(
                "enable.auto.offset.store must stay false: offsets are stored only after the \
                 database committed"
                    .into(),
            );
        }
        if self.settings.dlq_suffix.is_empty() || self.settings.retry_suffix.is_empty() {
            return fail("the dead-letter and retry suffixes must not be empty".into());
        }
        if self.settings.dlq_suffix == self.settings.retry_suffix {
            return fail("the dead-letter and retry suffixes must differ".into());
        }
        if self.settings.retry_tiers == 0 || self.settings.retry_tiers > 100 {
            return fail(format!(
                "retry_tiers must be between 1 and 100, not {}",
                self.settings.retry_tiers
            ));
        }
        let group = config.get("group.id").unwrap_or_default().to_owned();
        let mut routes = self.routes;
        routes.bind_group(&group).map_err(Error::Config)?;
        routes
            .bind_upcasters(self.settings.upcasters)
            .map_err(Error::Config)?;
        config.set("enable.auto.offset.store", "false");
        if config.get("auto.offset.reset").is_none() {
            config.set("auto.offset.reset", "earliest");
        }
        let mut producer_config = ClientConfig::new();
        for (key, value) in config.config_map() {
            if key == "bootstrap.servers"
                || key.starts_with("security.")
                || key.starts_with("sasl.")
                || key.starts_with("ssl.")
            {
                producer_config.set(key, value);
            }
        }
        // Each send is awaited until acknowledged: a bounded message timeout lets the consumer
        // see (and say) that a topic is missing or refuses, then try again.
        // The consumer waits for each send: no lingering for a batch to fill (a batch's sends
        // are queued together anyway).
        producer_config
            .set("message.timeout.ms", "30000")
            .set("topic.metadata.propagation.max.ms", "5000")
            .set("linger.ms", "0");
        for (key, value) in self.settings.producer_config.config_map() {
            producer_config.set(key, value);
        }
        producer_config
            .set("enable.idempotence", "true")
            .set("acks", "all");
        let forwarder: FutureProducer =
            producer_config
                .create()
                .map_err(|source| Error::KafkaClient {
                    client: "retry and dead-letter producer",
                    source,
                })?;
        Ok(Consumer {
            inner: Arc::new(Inner {
                pool: self.settings.pool,
                config,
                forwarder,
                routes,
                mode: self.settings.mode,
                max_attempts: self.settings.max_attempts,
                backoff: self.settings.backoff,
                dlq_suffix: self.settings.dlq_suffix,
                retry_policy: self.settings.retry_policy,
                retry_suffix: self.settings.retry_suffix,
                retry_tiers: self.settings.retry_tiers,
                processors: self.settings.processors,
                batch_size: self.settings.batch_size,
                poll_interval: self.settings.poll_interval,
            }),
        })
    }
}

/// Consumes events and hands them to handlers. See the [module documentation](super).
#[derive(Clone)]
pub struct Consumer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("mode", &self.inner.mode)
            .field("topics", &self.inner.routes.topics())
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub(super) pool: PgPool,
    pub(super) config: ClientConfig,
    pub(super) forwarder: FutureProducer,
    pub(super) routes: Routes,
    pub(super) mode: Mode,
    pub(super) max_attempts: u32,
    pub(super) backoff: Backoff,
    pub(super) dlq_suffix: String,
    pub(super) retry_policy: RetryPolicy,
    pub(super) retry_suffix: String,
    pub(super) retry_tiers: u32,
    pub(super) processors: usize,
    pub(super) batch_size: usize,
    pub(super) poll_interval: Duration,
}

/// Stores a handled message's offset for the next commit. If the partition moved to another
/// member meanwhile (a rebalance), the offset cannot be stored: the new owner gets the message
/// again and deduplicates it, so this only logs.
fn store_offset(consumer: &StreamConsumer, msg: &BorrowedMessage<'_>) {
    if let Err(e) = consumer.store_offset(msg.topic(), msg.partition(), msg.offset()) {
        tracing::info!(error = %crate::error_chain(&e), topic = msg.topic(), partition = msg.partition(),
            offset = msg.offset(), "offset not stored; the message will be seen again");
    }
}

impl Inner {
    /// The wait before a message's next attempt after its `attempt`-th failure.
    pub(super) fn backoff(&self, attempt: u32) -> Duration {
        self.backoff.delay(attempt)
    }

    /// The wait after the `failures`-th failure in a row of the database or the broker: jittered,
    /// so that the consumers an outage stopped together do not retry in lockstep.
    pub(super) fn outage_backoff(&self, failures: u32) -> Duration {
        self.backoff.jittered(failures)
    }

    /// Where a message that failed its `attempts`-th attempt goes.
    fn destination(&self, attempts: u32, failure: &Failure) -> Destination {
        if failure.is_permanent()
            || attempts >= self.max_attempts
            || self.retry_policy == RetryPolicy::InPlace
        {
            Destination::DeadLetter { attempts }
        } else {
            Destination::Retry {
                attempts,
                due_ms: message::now_ms() + self.backoff(attempts).as_millis() as i64,
            }
        }
    }

    /// The retry topic of source topic `source` for a message that failed `attempts` times.
    pub(super) fn retry_topic(&self, source: &str, attempts: u32) -> String {
        if self.retry_tiers == 1 {
            format!("{source}{}", self.retry_suffix)
        } else {
            let tier = attempts.clamp(1, self.retry_tiers);
            format!("{source}{}-{tier}", self.retry_suffix)
        }
    }

    /// The topics a consumer subscribes to: its handlers', and in dedup mode with retry
    /// topics, their retry topics.
    fn subscriptions(&self) -> Vec<String> {
        let mut topics = self.routes.topics();
        if self.mode == Mode::Dedup && self.retry_policy == RetryPolicy::Topic {
            let retry: Vec<String> = topics
                .iter()
                .flat_map(|t| (1..=self.retry_tiers).map(move |tier| self.retry_topic(t, tier)))
                .collect();
            topics.extend(retry);
        }
        topics
    }

    /// Handles checked messages in dedup mode, waiting out database failures (the messages
    /// are not at fault: nothing is stored until it commits, and the dedup rows make doing it
    /// again harmless). `None` once `cancel` fires.
    async fn handle_dedup(
        &self,
        messages: &[Checked<'_>],
        cancel: &CancellationToken,
    ) -> Option<dedup::Outcome> {
        let in_place = self.retry_policy == RetryPolicy::InPlace;
        let mut failures = 0;
        loop {
            match dedup::handle(&self.pool, &self.routes, messages, in_place).await {
                Ok(outcome) => {
                    metrics::counter!("outbox_consumer_processed_total")
                        .increment(outcome.processed);
                    metrics::counter!("outbox_consumer_duplicates_total")
                        .increment(outcome.duplicates);
                    return Some(outcome);
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %crate::error_chain(&e), "consumer cannot reach the database; retrying");
                    tokio::select! {
                        () = cancel.cancelled() => return None,
                        () = tokio::time::sleep(self.outage_backoff(failures)) => {}
                    }
                }
            }
        }
    }
}

/// The reason a dead letter carries.
fn dead_reason(failure: &Failure, attempts: u32) -> String {
    format!(
        "{} (after {attempts} attempt{})",
        failure.message(),
        if attempts == 1 { "" } else { "s" }
    )
}

/// Partitions of retry topics paused until their next message is due: topic, partition, when
/// it is due, its offset.
#[derive(Default)]
struct Held {
    partitions: Vec<(String, i32, i64, i64)>,
}

impl Held {
    /// Pauses `msg`'s partition and rewinds it to `msg`, until `due_ms`.
    fn hold(&mut self, consumer: &StreamConsumer, msg: &BorrowedMessage<'_>, due_ms: i64) {
        forward::hold(consumer, msg);
        self.partitions
            .retain(|(t, p, _, _)| (t.as_str(), *p) != (msg.topic(), msg.partition()));
        self.partitions.push((
            msg.topic().to_owned(),
            msg.partition(),
            due_ms,
            msg.offset(),
        ));
    }

    /// Whether `msg`'s partition is held. A message of a held partition can still come (one
    /// fetched before the pause, or after a blocked send resumed every partition): the
    /// partition is paused and rewound to its held message again, once per `batch` (a fresh
    /// list per batch).
    fn is_held(
        &self,
        consumer: &StreamConsumer,
        msg: &BorrowedMessage<'_>,
        batch: &mut Vec<(String, i32)>,
    ) -> bool {
        let Some((topic, partition, _, offset)) = self
            .partitions
            .iter()
            .find(|(t, p, _, _)| (t.as_str(), *p) == (msg.topic(), msg.partition()))
        else {
            return false;
        };
        if !batch.iter().any(|(t, p)| t == topic && p == partition) {
            forward::hold_at(consumer, topic, *partition, *offset);
            batch.push((topic.clone(), *partition));
        }
        true
    }

    /// How long until the first held partition is due.
    fn next_due(&self) -> Option<Duration> {
        let due = self.partitions.iter().map(|(_, _, due, _)| *due).min()?;
        Some(Duration::from_millis(
            u64::try_from(due - message::now_ms()).unwrap_or(0),
        ))
    }

    /// Resumes the partitions that are due.
    fn resume_due(&mut self, consumer: &StreamConsumer) {
        let now = message::now_ms();
        let mut tpl = TopicPartitionList::new();
        self.partitions.retain(|(topic, partition, due, _)| {
            let due = *due <= now;
            if due {
                tpl.add_partition(topic, *partition);
            }
            !due
        });
        if tpl.count() > 0 {
            // A partition no longer assigned cannot be resumed; its new owner reads it.
            if let Err(e) = consumer.resume(&tpl) {
                tracing::debug!(error = %crate::error_chain(&e), "cannot resume a retry partition");
            }
        }
    }
}

impl Consumer {
    /// A builder with the defaults; set at least the brokers, the group and one handler.
    pub fn builder(pool: PgPool) -> ConsumerBuilder {
        ConsumerBuilder {
            state: Arc::new(()),
            routes: Routes::default(),
            errors: Vec::new(),
            settings: Settings {
                pool,
                config: ClientConfig::new(),
                producer_config: ClientConfig::new(),
                mode: Mode::Dedup,
                max_attempts: 5,
                backoff: Backoff {
                    first: Duration::from_millis(200),
                    max: Duration::from_secs(30),
                },
                dlq_suffix: ".dlq".into(),
                retry_policy: RetryPolicy::Topic,
                retry_suffix: ".retry".into(),
                retry_tiers: 1,
                processors: 1,
                batch_size: 500,
                poll_interval: Duration::from_millis(200),
                upcasters: Upcasters::default(),
            },
        }
    }

    /// Runs the consumer on a tokio task until `cancel` fires; see [`run`](Self::run).
    pub fn spawn(&self, cancel: CancellationToken) -> JoinHandle<Result<()>> {
        let consumer = self.clone();
        tokio::spawn(async move { consumer.run(cancel).await })
    }

    /// Consumes until `cancel` fires. On cancel it finishes the messages (or inbox batch) in
    /// hand, commits the offsets of what the database committed, stops the processors after
    /// their batch, and returns. An inbox processor that stops on its own (it should not) is
    /// logged and restarted.
    pub async fn run(&self, cancel: CancellationToken) -> Result<()> {
        let inner = &self.inner;
        let consumer: StreamConsumer =
            inner.config.create().map_err(|source| Error::KafkaClient {
                client: "consumer",
                source,
            })?;
        let topics = inner.subscriptions();
        let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;
        let processors: Vec<_> = match inner.mode {
            Mode::Dedup => Vec::new(),
            Mode::Inbox => (0..inner.processors)
                .map(|_| self.spawn_supervised_processor(cancel.clone()))
                .collect(),
        };
        let result = match inner.mode {
            Mode::Dedup => self.consume_dedup(&consumer, &cancel).await,
            Mode::Inbox => self.receive_inbox(&consumer, &cancel).await,
        };
        // Commit what was stored (the database has committed all of it).
        if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
            tracing::debug!(error = %crate::error_chain(&e), "no offsets to commit on shutdown");
        }
        cancel.cancel();
        for p in processors {
            p.await.map_err(|source| Error::Task {
                task: "the inbox processor supervisor",
                source,
            })??;
        }
        result
    }

    /// The next batch: waits for one message, then takes what is already waiting (up to
    /// `batch_size`) without waiting for more. Resumes held retry partitions when they are
    /// due. `None` once cancelled.
    async fn next_batch<'c>(
        &self,
        consumer: &'c StreamConsumer,
        held: &mut Held,
        cancel: &CancellationToken,
    ) -> Option<Vec<BorrowedMessage<'c>>> {
        loop {
            held.resume_due(consumer);
            let wake = held.next_due();
            let first = tokio::select! {
                () = cancel.cancelled() => return None,
                msg = consumer.recv() => msg,
                () = tokio::time::sleep(wake.unwrap_or_default()), if wake.is_some() => continue,
            };
            let mut batch = Vec::with_capacity(self.inner.batch_size);
            match first {
                Ok(msg) => batch.push(msg),
                Err(e) => {
                    tracing::warn!(error = %crate::error_chain(&e), "kafka consumer error");
                    continue;
                }
            }
            while batch.len() < self.inner.batch_size {
                match tokio::time::timeout(Duration::ZERO, consumer.recv()).await {
                    Ok(Ok(msg)) => batch.push(msg),
                    _ => break,
                }
            }
            return Some(batch);
        }
    }

    /// Dedup mode. Messages are handled in batches, one transaction and one commit (one WAL
    /// flush) each (see [`dedup::handle`]). A failed message is forwarded (to its retry or
    /// dead-letter topic) before its offset is stored, offsets in order. A message from a
    /// retry topic that is not due yet holds its partition (paused, rewound) until it is.
    async fn consume_dedup(
        &self,
        consumer: &StreamConsumer,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let inner = &self.inner;
        let mut held = Held::default();
        while let Some(batch) = self.next_batch(consumer, &mut held, cancel).await {
            let now = message::now_ms();
            let mut ready: Vec<&BorrowedMessage<'_>> = Vec::with_capacity(batch.len());
            let mut reheld = Vec::new();
            for msg in &batch {
                if held.is_held(consumer, msg, &mut reheld) {
                    continue; // read again once its partition resumes
                }
                match message::due_ms(msg) {
                    Some(due) if due > now => held.hold(consumer, msg, due),
                    _ => ready.push(msg),
                }
            }
            let mut checked: Vec<Checked<'_>> = ready.iter().map(|m| message::check(m)).collect();
            let mut start = 0;
            // The message retried in place, and its attempts so far.
            let mut retrying: Option<(usize, u32)> = None;
            while start < checked.len() {
                let Some(outcome) = inner.handle_dedup(&checked[start..], cancel).await else {
                    return Ok(());
                };
                let settled = &ready[start..start + outcome.done];
                let forwards: Vec<Forward<'_, '_>> = outcome
                    .failed
                    .into_iter()
                    .map(|(i, failure)| {
                        let msg = settled[i];
                        let origin = message::origin(msg);
                        let attempts = match retrying {
                            Some((r, tries)) if r == start + i => tries + 1,
                            _ => origin.attempts + 1,
                        };
                        let destination = inner.destination(attempts, &failure);
                        let reason = match destination {
                            // Bad input was never tried.
                            _ if checked[start + i].is_err() => failure.message().to_owned(),
                            Destination::DeadLetter { .. } => dead_reason(&failure, attempts),
                            Destination::Retry { .. } => failure.message().to_owned(),
                        };
                        Forward {
                            msg,
                            source: origin.topic,
                            destination,
                            reason,
                        }
                    })
                    .collect();
                if inner
                    .forward_all(consumer, &forwards, cancel)
                    .await
                    .is_err()
                {
                    return Ok(()); // cancelled: their offsets stay unstored
                }
                for msg in settled {
                    store_offset(consumer, msg);
                }
                start += outcome.done;
                let Some(failure) = outcome.stopped else {
                    break;
                };
                // In place: the message at `start` failed retryably; try it (and what follows
                // it) again after a backoff, or dead-letter it once out of attempts.
                let tries = match retrying {
                    Some((r, tries)) if r == start => tries + 1,
                    _ => 1,
                };
                if tries >= inner.max_attempts {
                    let msg = ready[start];
                    let dead = Forward {
                        msg,
                        source: message::origin(msg).topic,
                        destination: Destination::DeadLetter { attempts: tries },
                        reason: dead_reason(&failure, tries),
                    };
                    if inner.forward(consumer, &dead, cancel).await.is_err() {
                        return Ok(());
                    }
                    store_offset(consumer, msg);
                    start += 1;
                    retrying = None;
                    continue;
                }
                metrics::counter!("outbox_consumer_retried_total").increment(1);
                tracing::info!(
                    attempt = tries,
                    error = failure.message(),
                    "handler failed; retrying in place"
                );
                retrying = Some((start, tries));
                if let Ok(incoming) = &mut checked[start] {
                    incoming.meta.attempt = tries + 1;
                }
                tokio::select! {
                    () = cancel.cancelled() => return Ok(()),
                    () = tokio::time::sleep(inner.backoff(tries)) => {}
                }
            }
        }
        Ok(())
    }

    /// Inbox mode's receipt: stores each batch in `inbox_event`, dead-letters what cannot be
    /// stored (not JSON, no event id, refused by `jsonb`), then stores the offsets.
    async fn receive_inbox(
        &self,
        consumer: &StreamConsumer,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let inner = &self.inner;
        let mut held = Held::default();
        while let Some(batch) = self.next_batch(consumer, &mut held, cancel).await {
            let mut rows = Vec::with_capacity(batch.len());
            let mut stored = Vec::with_capacity(batch.len());
            let mut bad: Vec<Option<String>> = vec![None; batch.len()];
            for (i, msg) in batch.iter().enumerate() {
                match message::check(msg) {
                    Ok(incoming) => {
                        stored.push(i);
                        let meta = &incoming.meta;
                        rows.push(store::InboxRow {
                            event_id: meta.event_id,
                            topic: meta.topic,
                            event_type: meta.event_type.clone().into_owned(),
                            partition_key: msg
                                .key()
                                .map(|k| String::from_utf8_lossy(k).into_owned()),
                            partition: msg.partition(),
                            offset: msg.offset(),
                            payload: incoming.payload,
                            headers: message::headers_json(meta),
                            schema_version: meta.schema_version,
                        });
                    }
                    Err(reason) => bad[i] = Some(reason),
                }
            }
            let mut failures = 0;
            let received = loop {
                match store::receive(&inner.pool, &rows).await {
                    Ok(received) => break received,
                    Err(e) => {
                        failures += 1;
                        tracing::warn!(error = %crate::error_chain(&e), "cannot store received messages; retrying");
                        tokio::select! {
                            () = cancel.cancelled() => return Ok(()),
                            () = tokio::time::sleep(inner.outage_backoff(failures)) => {}
                        }
                    }
                }
            };
            metrics::counter!("outbox_inbox_received_total").increment(received.new);
            let refused = received.refused.len() as u64;
            metrics::counter!("outbox_consumer_duplicates_total")
                .increment(rows.len() as u64 - received.new - refused);
            for (row, reason) in received.refused {
                bad[stored[row]] = Some(reason);
            }
            let dead: Vec<Forward<'_, '_>> = batch
                .iter()
                .zip(bad)
                .filter_map(|(msg, reason)| {
                    let reason = reason?;
                    Some(Forward {
                        msg,
                        source: message::origin(msg).topic,
                        destination: Destination::DeadLetter { attempts: 1 },
                        reason,
                    })
                })
                .collect();
            if inner.forward_all(consumer, &dead, cancel).await.is_err() {
                return Ok(()); // cancelled: the batch's offsets stay unstored
            }
            for msg in &batch {
                store_offset(consumer, msg);
            }
        }
        Ok(())
    }

    /// Runs an inbox processor on a task, and runs it again if it ever stops before `cancel`
    /// (a bug: handler failures and panics are the rows' business, database failures are
    /// waited out), so that receipt never goes on storing offsets with nothing processing.
    fn spawn_supervised_processor(&self, cancel: CancellationToken) -> JoinHandle<Result<()>> {
        let consumer = self.clone();
        tokio::spawn(async move {
            let mut restarts = 0;
            loop {
                let processor = consumer.clone();
                let token = cancel.clone();
                let ended = tokio::spawn(async move { processor.run_processor(token).await }).await;
                if cancel.is_cancelled() {
                    return match ended {
                        Ok(result) => result,
                        Err(source) => Err(Error::Task {
                            task: "an inbox processor",
                            source,
                        }),
                    };
                }
                restarts += 1;
                metrics::counter!("outbox_inbox_processor_restarts_total").increment(1);
                match ended {
                    Ok(Ok(())) => tracing::error!("an inbox processor stopped; restarting it"),
                    Ok(Err(e)) => {
                        tracing::error!(error = %crate::error_chain(&e), "an inbox processor failed; restarting it")
                    }
                    Err(e) => {
                        tracing::error!(error = %crate::error_chain(&e), "an inbox processor panicked; restarting it")
                    }
                }
                tokio::select! {
                    () = cancel.cancelled() => return Ok(()),
                    () = tokio::time::sleep(consumer.inner.outage_backoff(restarts)) => {}
                }
            }
        })
    }

    /// Runs one inbox processor until `cancel` fires (a consumer in [`Mode::Inbox`] runs
    /// `processors` of them itself).
    pub async fn run_processor(&self, cancel: CancellationToken) -> Result<()> {
        let inner = &self.inner;
        let mut failures = 0;
        let mut gauges_at: Option<std::time::Instant> = None;
        while !cancel.is_cancelled() {
            if gauges_at.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                gauges_at = Some(std::time::Instant::now());
                match inbox_status(&inner.pool).await {
                    Ok(s) => {
                        metrics::gauge!("outbox_inbox_backlog").set(s.unprocessed as f64);
                        metrics::gauge!("outbox_inbox_dead").set(s.dead as f64);
                        metrics::gauge!("outbox_inbox_lag_seconds")
                            .set(s.oldest_unprocessed_age.map_or(0.0, |a| a.as_secs_f64()));
                    }
                    Err(e) => {
                        tracing::debug!(error = %crate::error_chain(&e), "cannot read the inbox backlog")
                    }
                }
            }
            match store::process_batch(inner, &inner.routes).await {
                Ok(n) if n >= inner.batch_size => failures = 0,
                Ok(_) => {
                    failures = 0;
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        () = tokio::time::sleep(inner.poll_interval) => {}
                    }
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %crate::error_chain(&e), "inbox processor batch failed; retrying");
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        () = tokio::time::sleep(inner.outage_backoff(failures)) => {}
                    }
                }
            }
        }
        Ok(())
    }

    /// Processes the inbox until no row is due, once, and returns how many rows it handled
    /// (processed or failed). For tests and scripts.
    pub async fn process_inbox_pending(&self) -> Result<u64> {
        let mut total = 0;
        loop {
            let n = store::process_batch(&self.inner, &self.inner.routes).await?;
            total += n as u64;
            if n < self.inner.batch_size {
                return Ok(total);
            }
        }
    }

    /// Inbox backlog figures.
    pub async fn inbox_status(&self) -> Result<InboxStatus> {
        inbox_status(&self.inner.pool).await
    }
}
