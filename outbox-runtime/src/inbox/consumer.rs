//! The Kafka consumer: dedup mode, inbox receipt and processors.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use super::handler::{Failure, Handler, Routes};
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

/// Configures a [`Consumer`]. Start with [`Consumer::builder`].
#[must_use]
pub struct ConsumerBuilder {
    pool: PgPool,
    config: ClientConfig,
    routes: Routes,
    errors: Vec<String>,
    mode: Mode,
    max_attempts: u32,
    backoff: Backoff,
    dlq_suffix: String,
    processors: usize,
    batch_size: usize,
    poll_interval: Duration,
}

impl std::fmt::Debug for ConsumerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("mode", &self.mode)
            .field("topics", &self.routes.topics())
            .finish_non_exhaustive()
    }
}

impl ConsumerBuilder {
    /// Kafka bootstrap servers.
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.config.set("bootstrap.servers", brokers.into());
        self
    }

    /// The consumer group (required).
    pub fn group_id(mut self, group: impl Into<String>) -> Self {
        self.config.set("group.id", group.into());
        self
    }

    /// Consumer settings (security, ...); they win over the defaults. The consumer always
    /// stores offsets itself (`enable.auto.offset.store=false`): `build` refuses `true`.
    pub fn consumer_config(mut self, config: ClientConfig) -> Self {
        for (key, value) in config.config_map() {
            self.config.set(key, value);
        }
        self
    }

    /// Registers a handler (see `#[inbox_handler]`). Messages are routed by their topic and
    /// `event_type` header to every handler of that event type.
    pub fn handler<H: Handler>(mut self, handler: H) -> Self {
        if let Err(e) = self.routes.add(handler) {
            self.errors.push(e);
        }
        self
    }

    /// [`Mode::Dedup`] (default) or [`Mode::Inbox`].
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Tries of a retryable failure before the message is dead-lettered (default 5).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// Wait before a retry, doubling up to `max` (defaults 200 ms and 30 s).
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = Backoff { first, max };
        self
    }

    /// Dead-letter topic of topic `t`: `t` + this suffix (default `.dlq`).
    pub fn dlq_suffix(mut self, suffix: impl Into<String>) -> Self {
        self.dlq_suffix = suffix.into();
        self
    }

    /// Inbox processor tasks this consumer runs (default 1; 0 runs none, for a deployment
    /// whose processors run elsewhere).
    pub fn processors(mut self, processors: usize) -> Self {
        self.processors = processors;
        self
    }

    /// Messages stored per inbox insert, and rows claimed per processor batch (default 500).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// How often an idle inbox processor looks for rows (default 200 ms).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
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
        let mut config = self.config;
        config::check_common(
            config.get("bootstrap.servers"),
            self.batch_size,
            self.poll_interval,
            self.max_attempts,
            self.backoff,
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
        if self.dlq_suffix.is_empty() {
            return fail("the dead-letter suffix must not be empty".into());
        }
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
        producer_config
            .set("enable.idempotence", "true")
            .set("acks", "all");
        let dlq: FutureProducer = producer_config
            .create()
            .map_err(|e| Error::Config(format!("cannot create the dead-letter producer: {e}")))?;
        Ok(Consumer {
            inner: Arc::new(Inner {
                pool: self.pool,
                config,
                dlq,
                routes: self.routes,
                mode: self.mode,
                max_attempts: self.max_attempts,
                backoff: self.backoff,
                dlq_suffix: self.dlq_suffix,
                processors: self.processors,
                batch_size: self.batch_size,
                poll_interval: self.poll_interval,
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
    pub(super) dlq: FutureProducer,
    pub(super) routes: Routes,
    pub(super) mode: Mode,
    pub(super) max_attempts: u32,
    pub(super) backoff: Backoff,
    pub(super) dlq_suffix: String,
    pub(super) processors: usize,
    pub(super) batch_size: usize,
    pub(super) poll_interval: Duration,
}

/// A message read off Kafka, checked.
pub(super) struct Incoming<'m> {
    pub(super) event_id: Uuid,
    pub(super) event_type: String,
    pub(super) payload: &'m [u8],
}

fn header<'m>(msg: &'m BorrowedMessage<'_>, name: &str) -> Option<&'m [u8]> {
    msg.headers()?.iter().find(|h| h.key == name)?.value
}

/// Checks what every message needs; the error is the dead-letter reason.
pub(super) fn check<'m>(msg: &'m BorrowedMessage<'_>) -> std::result::Result<Incoming<'m>, String> {
    let payload = msg.payload().unwrap_or_default();
    serde_json::from_slice::<serde::de::IgnoredAny>(payload)
        .map_err(|e| format!("payload is not JSON: {e}"))?;
    if payload.windows(6).any(|w| w == b"\\u0000") {
        return Err("payload holds a \\u0000 escape, which PostgreSQL's jsonb cannot store".into());
    }
    let event_id = header(msg, "event_id").ok_or("message has no event_id header")?;
    let event_id = std::str::from_utf8(event_id)
        .ok()
        .and_then(|s| Uuid::parse_str(s).ok())
        .ok_or("event_id header is not a UUID")?;
    let event_type = header(msg, "event_type")
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .unwrap_or_default();
    Ok(Incoming {
        event_id,
        event_type,
        payload,
    })
}

/// Stores a handled message's offset for the next commit. If the partition moved to another
/// member meanwhile (a rebalance), the offset cannot be stored: the new owner gets the message
/// again and deduplicates it, so this only logs.
fn store_offset(consumer: &StreamConsumer, msg: &BorrowedMessage<'_>) {
    if let Err(e) = consumer.store_offset(msg.topic(), msg.partition(), msg.offset()) {
        tracing::info!(error = %e, topic = msg.topic(), partition = msg.partition(),
            offset = msg.offset(), "offset not stored; the message will be seen again");
    }
}

impl Inner {
    pub(super) fn backoff(&self, attempt: u32) -> Duration {
        self.backoff.delay(attempt)
    }

    /// Sends the message to its dead-letter topic and waits for the broker's acknowledgement
    /// (retrying until it comes or `cancel` fires).
    async fn dead_letter(
        &self,
        msg: &BorrowedMessage<'_>,
        reason: &str,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let topic = format!("{}{}", msg.topic(), self.dlq_suffix);
        let partition = msg.partition().to_string();
        let offset = msg.offset().to_string();
        let mut failures = 0;
        loop {
            let mut headers = OwnedHeaders::new();
            if let Some(h) = msg.headers() {
                for header in h.iter() {
                    headers = headers.insert(header);
                }
            }
            headers = headers
                .insert(Header {
                    key: "dlq_error",
                    value: Some(reason.as_bytes()),
                })
                .insert(Header {
                    key: "dlq_source_topic",
                    value: Some(msg.topic().as_bytes()),
                })
                .insert(Header {
                    key: "dlq_source_partition",
                    value: Some(partition.as_bytes()),
                })
                .insert(Header {
                    key: "dlq_source_offset",
                    value: Some(offset.as_bytes()),
                });
            let mut record: FutureRecord<'_, [u8], [u8]> =
                FutureRecord::to(&topic).headers(headers);
            if let Some(key) = msg.key() {
                record = record.key(key);
            }
            if let Some(payload) = msg.payload() {
                record = record.payload(payload);
            }
            match self.dlq.send(record, Duration::from_secs(30)).await {
                Ok(_) => {
                    metrics::counter!("outbox_consumer_dead_lettered_total").increment(1);
                    tracing::warn!(topic = msg.topic(), partition = msg.partition(),
                        offset = msg.offset(), %reason, "message dead-lettered");
                    return Ok(());
                }
                Err((e, _)) => {
                    failures += 1;
                    tracing::warn!(error = %e, dlq = %topic, "cannot reach the dead-letter topic; retrying");
                    tokio::select! {
                        () = cancel.cancelled() => return Err(Error::Kafka(e)),
                        () = tokio::time::sleep(self.backoff(failures)) => {}
                    }
                }
            }
        }
    }

    /// Dedup mode: runs every handler of the message once (deduplicated), retrying or
    /// dead-lettering failures. Returns when the offset may be stored.
    async fn handle_dedup(
        &self,
        msg: &BorrowedMessage<'_>,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let incoming = match check(msg) {
            Ok(incoming) => incoming,
            Err(reason) => return self.dead_letter(msg, &reason, cancel).await,
        };
        for handler in self.routes.get(msg.topic(), &incoming.event_type) {
            let mut attempt = 0;
            loop {
                attempt += 1;
                let result = store::run_deduplicated(
                    &self.pool,
                    handler.as_ref(),
                    incoming.event_id,
                    incoming.payload,
                )
                .await;
                match result {
                    Ok(true) => {
                        metrics::counter!("outbox_consumer_processed_total").increment(1);
                        break;
                    }
                    Ok(false) => {
                        metrics::counter!("outbox_consumer_duplicates_total").increment(1);
                        break;
                    }
                    Err(store::DedupError::Database(e)) => {
                        // The database, not the message, failed: wait and try again, forever.
                        tracing::warn!(error = %e, "consumer cannot reach the database; retrying");
                        attempt -= 1;
                        tokio::select! {
                            () = cancel.cancelled() => return Err(e),
                            () = tokio::time::sleep(self.backoff.max.min(Duration::from_secs(1))) => {}
                        }
                    }
                    Err(store::DedupError::Handler(Failure::Retryable(e)))
                        if attempt < self.max_attempts =>
                    {
                        metrics::counter!("outbox_consumer_retried_total").increment(1);
                        tracing::info!(attempt, error = %e, "handler failed; retrying");
                        tokio::select! {
                            () = cancel.cancelled() => return Err(Error::Publish(e)),
                            () = tokio::time::sleep(self.backoff(attempt)) => {}
                        }
                    }
                    Err(store::DedupError::Handler(failure)) => {
                        let reason = format!(
                            "{} (after {attempt} attempt{})",
                            failure.message(),
                            if attempt == 1 { "" } else { "s" }
                        );
                        self.dead_letter(msg, &reason, cancel).await?;
                        break;
                    }
                }
            }
        }
        Ok(())
    }
}

impl Consumer {
    /// A builder with the defaults; set at least the brokers, the group and one handler.
    pub fn builder(pool: PgPool) -> ConsumerBuilder {
        ConsumerBuilder {
            pool,
            config: ClientConfig::new(),
            routes: Routes::default(),
            errors: Vec::new(),
            mode: Mode::Dedup,
            max_attempts: 5,
            backoff: Backoff {
                first: Duration::from_millis(200),
                max: Duration::from_secs(30),
            },
            dlq_suffix: ".dlq".into(),
            processors: 1,
            batch_size: 500,
            poll_interval: Duration::from_millis(200),
        }
    }

    /// Runs the consumer on a tokio task until `cancel` fires; see [`run`](Self::run).
    pub fn spawn(&self, cancel: CancellationToken) -> JoinHandle<Result<()>> {
        let consumer = self.clone();
        tokio::spawn(async move { consumer.run(cancel).await })
    }

    /// Consumes until `cancel` fires. On cancel it finishes the message (or inbox batch) in
    /// hand, commits the offsets of what the database committed, stops the processors after
    /// their batch, and returns.
    pub async fn run(&self, cancel: CancellationToken) -> Result<()> {
        let inner = &self.inner;
        let consumer: StreamConsumer = inner
            .config
            .create()
            .map_err(|e| Error::Config(format!("cannot create the Kafka consumer: {e}")))?;
        let topics = inner.routes.topics();
        let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;
        let processors: Vec<_> = match inner.mode {
            Mode::Dedup => Vec::new(),
            Mode::Inbox => (0..inner.processors)
                .map(|_| self.spawn_processor(cancel.clone()))
                .collect(),
        };
        let result = match inner.mode {
            Mode::Dedup => self.consume_dedup(&consumer, &cancel).await,
            Mode::Inbox => self.receive_inbox(&consumer, &cancel).await,
        };
        // Commit what was stored (the database has committed all of it).
        if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
            tracing::debug!(error = %e, "no offsets to commit on shutdown");
        }
        cancel.cancel();
        for p in processors {
            p.await
                .map_err(|e| Error::Config(format!("inbox processor panicked: {e}")))??;
        }
        result
    }

    /// The next batch: waits for one message, then takes what is already waiting (up to
    /// `batch_size`) without waiting for more. `None` once cancelled.
    async fn next_batch<'c>(
        &self,
        consumer: &'c StreamConsumer,
        cancel: &CancellationToken,
    ) -> Option<Vec<BorrowedMessage<'c>>> {
        loop {
            let first = tokio::select! {
                () = cancel.cancelled() => return None,
                msg = consumer.recv() => msg,
            };
            let mut batch = Vec::with_capacity(self.inner.batch_size);
            match first {
                Ok(msg) => batch.push(msg),
                Err(e) => {
                    tracing::warn!(error = %e, "kafka consumer error");
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
    /// flush) each: first optimistically (all dedup rows in one statement, then the handlers);
    /// if a handler fails, again with a savepoint per message and handler. A message whose
    /// handler fails retryably ends the batch (what came before commits) and is retried on its
    /// own, with backoff; then the batch goes on after it.
    async fn consume_dedup(
        &self,
        consumer: &StreamConsumer,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let inner = &self.inner;
        while let Some(batch) = self.next_batch(consumer, cancel).await {
            let mut rest: &[BorrowedMessage<'_>] = &batch;
            while !rest.is_empty() {
                let mut failures = 0;
                let outcome = loop {
                    let fast = store::dedup_batch_optimistic(&inner.pool, &inner.routes, rest);
                    let result = match fast.await {
                        Ok(Ok(outcome)) => Ok(outcome),
                        Ok(Err(known)) => {
                            store::dedup_batch(&inner.pool, &inner.routes, rest, Some(known)).await
                        }
                        Err(e) => Err(e),
                    };
                    match result {
                        Ok(outcome) => break outcome,
                        Err(e) => {
                            // The database, not the messages, failed: wait and try again.
                            failures += 1;
                            tracing::warn!(error = %e, "consumer cannot reach the database; retrying");
                            tokio::select! {
                                () = cancel.cancelled() => return Ok(()),
                                () = tokio::time::sleep(inner.backoff(failures)) => {}
                            }
                        }
                    }
                };
                metrics::counter!("outbox_consumer_processed_total").increment(outcome.processed);
                metrics::counter!("outbox_consumer_duplicates_total").increment(outcome.duplicates);
                // A message retried on its own below is dead-lettered there if it must be.
                for (i, reason) in outcome.dead.iter().filter(|(i, _)| *i < outcome.done) {
                    inner.dead_letter(&rest[*i], reason, cancel).await?;
                }
                for msg in &rest[..outcome.done] {
                    store_offset(consumer, msg);
                }
                rest = &rest[outcome.done..];
                if outcome.retry {
                    let msg = &rest[0];
                    let span = tracing::info_span!(
                        "outbox_consume",
                        topic = msg.topic(),
                        partition = msg.partition(),
                        offset = msg.offset()
                    );
                    match inner.handle_dedup(msg, cancel).instrument(span).await {
                        Ok(()) => store_offset(consumer, msg),
                        // Cancelled while waiting to retry: the offset stays unstored, so the
                        // message comes again after a restart.
                        Err(_) if cancel.is_cancelled() => return Ok(()),
                        Err(e) => return Err(e),
                    }
                    rest = &rest[1..];
                }
            }
        }
        Ok(())
    }

    async fn receive_inbox(
        &self,
        consumer: &StreamConsumer,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let inner = &self.inner;
        while let Some(batch) = self.next_batch(consumer, cancel).await {
            let mut rows = Vec::with_capacity(batch.len());
            let mut bad = Vec::new();
            for msg in &batch {
                match check(msg) {
                    Ok(incoming) => rows.push(store::InboxRow {
                        event_id: incoming.event_id,
                        topic: msg.topic(),
                        event_type: incoming.event_type,
                        partition_key: msg.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                        payload: incoming.payload,
                    }),
                    Err(reason) => bad.push((msg, reason)),
                }
            }
            let mut failures = 0;
            loop {
                match store::receive(&inner.pool, &rows).await {
                    Ok(n) => {
                        metrics::counter!("outbox_inbox_received_total").increment(n);
                        metrics::counter!("outbox_consumer_duplicates_total")
                            .increment(rows.len() as u64 - n);
                        break;
                    }
                    Err(e) => {
                        failures += 1;
                        tracing::warn!(error = %e, "cannot store received messages; retrying");
                        tokio::select! {
                            () = cancel.cancelled() => return Ok(()),
                            () = tokio::time::sleep(inner.backoff(failures)) => {}
                        }
                    }
                }
            }
            for (msg, reason) in bad {
                inner.dead_letter(msg, &reason, cancel).await?;
            }
            for msg in &batch {
                store_offset(consumer, msg);
            }
        }
        Ok(())
    }

    fn spawn_processor(&self, cancel: CancellationToken) -> JoinHandle<Result<()>> {
        let consumer = self.clone();
        tokio::spawn(async move { consumer.run_processor(cancel).await })
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
                    Err(e) => tracing::debug!(error = %e, "cannot read the inbox backlog"),
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
                    tracing::warn!(error = %e, "inbox processor batch failed; retrying");
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        () = tokio::time::sleep(inner.backoff(failures)) => {}
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
