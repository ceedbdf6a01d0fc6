//! Consuming from RabbitMQ: for each topic, one reader per shard queue of the group, each
//! with its own connection and a channel in confirm mode, subscribed as one of the queue's
//! consumers. The queue has a single active consumer, so however many instances of the group
//! run, one of them receives a shard's messages, in order; its batches are handled as
//! Kafka's are ([`dedup`] in dedup mode, [`receive`] in inbox mode), each message acknowledged
//! only once the database committed it.
//!
//! A retryable failure (dedup mode, [`RetryPolicy::Topic`](crate::inbox::RetryPolicy)) is
//! published to the shard's delay queue with its backoff as its expiration, confirmed, and
//! only then the original acknowledged: it comes back to the shard queue's tail when due, after
//! its key's later messages, as Kafka's retry topic does (with `RetryPolicy::InPlace`, the core
//! retries it where it is, and nothing overtakes it). A dead letter is published to the
//! topic's dead-letter queue, confirmed, then the original acknowledged. A message whose
//! consumer keeps going away before acknowledging it (a handler that takes the process down)
//! is dead-lettered by the server after its delivery limit, with the server's `x-death`
//! headers (`reason: delivery_limit`) instead of the `dlq_*` ones. A connection or channel that closes ends the shard's session: what was not acknowledged
//! goes back to the queue (before anything newer) and to the next active consumer, this one
//! included once it has connected again.

use std::sync::Arc;
use std::time::Duration;

use amqprs::channel::{
    BasicAckArguments, BasicConsumeArguments, BasicQosArguments, ConsumerMessage,
};
use amqprs::BasicProperties;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

use super::confirm::{self, Confirming};
use super::settings::RabbitMq;
use super::topology::Topology;
use super::wire::{self, Decoded};
use crate::error::{Error, Result};
use crate::inbox::batch::Checked;
use crate::inbox::failure::Destination;
use crate::inbox::message::{self, Delivered};
use crate::inbox::settings::{Mode, Settings};
use crate::inbox::shared::Shared;
use crate::inbox::source::{Reading, Reads, Source};
use crate::inbox::{dedup, receive};
use crate::publish::{Boxed, Outcome};

/// How long the server gets to answer a request of the consumer's.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// How often a reader waiting for messages checks that its connection is still open.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// How often a shard that keeps failing is said at warning level.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// A consumer's RabbitMQ.
struct Consumer {
    rabbitmq: RabbitMq,
}

impl Reads for RabbitMq {
    fn source(&self, _settings: &Settings) -> Result<Box<dyn Source>> {
        Ok(Box::new(Consumer {
            rabbitmq: self.clone(),
        }))
    }
}

impl Source for Consumer {
    fn consume<'a>(
        &'a self,
        shared: &'a Arc<Shared>,
        cancel: &'a CancellationToken,
    ) -> Boxed<'a, Result<()>> {
        Box::pin(consume(shared, &self.rabbitmq, cancel))
    }
}

/// Reads every shard of every handled topic until `cancel` fires.
async fn consume(
    shared: &Arc<Shared>,
    rabbitmq: &RabbitMq,
    cancel: &CancellationToken,
) -> Result<()> {
    for topic in shared.routes.topics() {
        super::topology::check_names(rabbitmq, &shared.settings, &topic).map_err(Error::Config)?;
    }
    let mut readers = tokio::task::JoinSet::new();
    for topic in shared.routes.topics() {
        for shard in 0..rabbitmq.shards {
            let reader = Reader {
                shared: Arc::clone(shared),
                rabbitmq: rabbitmq.clone(),
                topic: topic.clone(),
                shard,
                cancel: cancel.clone(),
                dead_letters: shared.settings.topics.dead_letter(&topic),
                topic_name: Arc::from(topic.as_str()),
                channel: tokio::sync::Mutex::new(None),
            };
            readers.spawn(reader.run());
        }
    }
    while let Some(joined) = readers.join_next().await {
        if let Err(source) = joined {
            cancel.cancel();
            return Err(Error::Task {
                task: "a RabbitMQ shard's reader",
                source,
            });
        }
    }
    Ok(())
}

/// One shard queue's reader.
struct Reader {
    shared: Arc<Shared>,
    rabbitmq: RabbitMq,
    topic: String,
    shard: u16,
    cancel: CancellationToken,
    /// The topic's dead-letter queue.
    dead_letters: String,
    /// The topic, shared by the messages read.
    topic_name: Arc<str>,
    /// The session's channel (what delivered the batch in hand, and settles it).
    channel: tokio::sync::Mutex<Option<Confirming>>,
}

/// Why a session ended.
enum Ended {
    Cancelled,
    /// The connection or channel closed, or could not be opened; whether a batch was handled.
    Lost {
        error: Option<String>,
        handled: bool,
    },
}

impl Reader {
    fn topology(&self) -> Topology<'_> {
        let topics = &self.shared.settings.topics;
        Topology {
            settings: &self.rabbitmq,
            topic: &self.topic,
            group: self.shared.settings.group(),
            retry_suffix: &topics.retry_suffix,
            dead_letters: &self.dead_letters,
        }
    }

    /// Reads until `cancel` fires, opening a session again (after the outage backoff) each time
    /// one is lost.
    async fn run(self) {
        let mut failures = 0u32;
        // When a failure was last said at warning level: the first of a run of failures, and
        // then one every `WARN_EVERY` while it lasts (a shard that never comes back, such as
        // a quorum queue without a leader, is not silent).
        let mut warned: Option<tokio::time::Instant> = None;
        loop {
            match self.session().await {
                Ended::Cancelled => break,
                Ended::Lost { error, handled } => {
                    if handled {
                        failures = 0;
                        warned = None;
                    }
                    failures += 1;
                    if let Some(e) = error {
                        if warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
                            warned = Some(tokio::time::Instant::now());
                            tracing::warn!(topic = %self.topic, shard = self.shard, failures,
                                error = %e, "cannot read from RabbitMQ; trying again");
                        } else {
                            tracing::debug!(topic = %self.topic, shard = self.shard, error = %e,
                                "cannot read from RabbitMQ; trying again");
                        }
                    }
                }
            }
            if let Some(old) = self.channel.lock().await.take() {
                old.give_up("the session ended");
            }
            let wait = self.shared.settings.outage_backoff(failures);
            tokio::select! {
                () = self.cancel.cancelled() => break,
                () = tokio::time::sleep(wait) => {}
            }
        }
        if let Some(old) = self.channel.lock().await.take() {
            old.give_up("the consumer stopped");
        }
    }

    /// Connects, declares (if told to), subscribes, and reads batches until the channel
    /// closes or `cancel` fires.
    async fn session(&self) -> Ended {
        let lost = |e: String| Ended::Lost {
            error: Some(e),
            handled: false,
        };
        let name = format!("consumer {} {}", self.shared.settings.group(), self.queue());
        let opened = tokio::select! {
            () = self.cancel.cancelled() => return Ended::Cancelled,
            opened = Confirming::open(&self.rabbitmq, &name, ANSWER_WITHIN, None) => opened,
        };
        let channel = match opened {
            Ok(channel) => channel,
            Err(e) => return lost(e),
        };
        let missing =
            metrics::gauge!("outbox_consumer_missing_topic", "topic" => self.topic.clone());
        if self.rabbitmq.declare {
            if let Err(e) = self
                .topology()
                .declare(&channel.link.channel, self.shard, ANSWER_WITHIN)
                .await
            {
                let e = channel.link.closed.explain(e);
                channel.give_up(&e);
                return lost(e);
            }
        }
        let mut deliveries = match self.subscribe(&channel).await {
            Ok(deliveries) => deliveries,
            Err(e) => {
                let e = channel.link.closed.explain(e);
                if channel.link.closed.code() == Some(super::link::NOT_FOUND) {
                    missing.set(1.0);
                    tracing::warn!(topic = %self.topic, queue = %self.queue(),
                        "the shard queue does not exist: waiting for it (`outbox topics ensure \
                         --transport rabbitmq`, or let the consumer: RabbitMq::declare_topology)");
                }
                channel.give_up(&e);
                return lost(e);
            }
        };
        missing.set(0.0);
        *self.channel.lock().await = Some(channel);
        self.read(&mut deliveries).await
    }

    /// This shard's queue.
    fn queue(&self) -> String {
        self.topology().shard_queue(self.shard)
    }

    /// Sets the prefetch to one message (see [`read`](Self::read)) and subscribes to the shard
    /// queue.
    async fn subscribe(
        &self,
        channel: &Confirming,
    ) -> std::result::Result<UnboundedReceiver<ConsumerMessage>, String> {
        let settings = &self.shared.settings;
        let amqp = &channel.link.channel;
        super::link::timed(
            ANSWER_WITHIN,
            "cannot set the prefetch",
            amqp.basic_qos(BasicQosArguments::new(0, 1, false)),
        )
        .await?;
        let tag = format!(
            "outbox-{}-{}",
            settings.group(),
            uuid::Uuid::new_v4().simple()
        );
        let mut args = BasicConsumeArguments::new(&self.queue(), &tag);
        args.manual_ack(true);
        let queue = self.queue();
        let (_, deliveries) = super::link::timed(
            ANSWER_WITHIN,
            &format!("cannot consume from the queue `{queue}`"),
            amqp.basic_consume_rx(args),
        )
        .await
        .map_err(|e| {
            if self.rabbitmq.quorum && e.contains("did not answer") {
                // A quorum queue with no leader holds the request until one is elected.
                format!(
                    "{e} (a quorum queue without a leader answers nothing until it has one: \
                     `rabbitmq-queues quorum_status {queue}`; with a Ra older than \
                     rabbitmq/ra#443, as in RabbitMQ 3.10, a node killed just after declaring \
                     a queue can bring it back leaderless for good, rabbitmq/rabbitmq-server#15725: \
                     delete it and declare it again, then `outbox replay` what it held)"
                )
            } else {
                e
            }
        })?;
        Ok(deliveries)
    }

    /// Whether the session's channel is still open.
    async fn open(&self) -> bool {
        self.channel
            .lock()
            .await
            .as_ref()
            .is_some_and(Confirming::is_open)
    }

    /// Widens the prefetch to two batches.
    async fn widen(&self) -> bool {
        let prefetch = u16::try_from(self.shared.settings.batch_size * 2).unwrap_or(u16::MAX);
        let guard = self.channel.lock().await;
        let Some(channel) = guard.as_ref() else {
            return false;
        };
        super::link::timed(
            ANSWER_WITHIN,
            "cannot set the prefetch",
            channel
                .link
                .channel
                .basic_qos(BasicQosArguments::new(0, prefetch, false)),
        )
        .await
        .is_ok()
    }

    /// Reads batches until the channel closes or `cancel` fires (a batch in hand is then given
    /// up: nothing of it acknowledged, it comes again).
    ///
    /// A session reads one message at a time (prefetch 1) until one comes that no consumer
    /// held before, then widens the prefetch to two batches. The server counts a return for
    /// each message a departing consumer held, and dead-letters at [`DELIVERY_LIMIT`]: with a
    /// batch in hand, the messages behind one that takes its consumer down would go with it.
    ///
    /// [`DELIVERY_LIMIT`]: super::topology::DELIVERY_LIMIT
    async fn read(&self, deliveries: &mut UnboundedReceiver<ConsumerMessage>) -> Ended {
        let batch_size = self.shared.settings.batch_size;
        let mut careful = true;
        let mut handled = false;
        let mut check = tokio::time::interval(CHECK_EVERY);
        loop {
            let first = tokio::select! {
                () = self.cancel.cancelled() => return Ended::Cancelled,
                next = deliveries.recv() => next,
                _ = check.tick() => {
                    if self.open().await {
                        continue;
                    }
                    None
                }
            };
            let Some(first) = first else {
                return Ended::Lost {
                    error: Some("the channel closed".into()),
                    handled,
                };
            };
            let mut batch: Vec<Received> =
                Received::new(&self.topic_name, first).into_iter().collect();
            while !careful && batch.len() < batch_size {
                match deliveries.try_recv() {
                    Ok(next) => batch.extend(Received::new(&self.topic_name, next)),
                    Err(_) => break,
                }
            }
            if batch.is_empty() {
                continue;
            }
            let done = match self.shared.settings.mode {
                Mode::Dedup => dedup::handle_batch(&self.shared, self, &batch, &self.cancel).await,
                Mode::Inbox => {
                    receive::receive_batch(&self.shared, self, &batch, &self.cancel).await
                }
            };
            if !done {
                return if self.cancel.is_cancelled() {
                    Ended::Cancelled
                } else {
                    Ended::Lost {
                        error: Some("the channel closed while a batch was settled".into()),
                        handled,
                    }
                };
            }
            handled = true;
            if careful && batch.iter().all(|m| m.decoded.returned == 0) {
                if !self.widen().await {
                    return Ended::Lost {
                        error: Some("cannot widen the prefetch".into()),
                        handled,
                    };
                }
                careful = false;
            }
        }
    }

    /// Acknowledges delivery `tag` and every one before it on this channel (`multiple`): the
    /// batches are settled in the order delivered, so everything before `tag` is settled
    /// already. A lost acknowledgement (the channel closed) brings the messages again,
    /// deduplicated.
    async fn ack_up_to(&self, tag: u64) -> bool {
        let guard = self.channel.lock().await;
        let Some(channel) = guard.as_ref() else {
            return false;
        };
        let acked = super::link::timed(
            ANSWER_WITHIN,
            "cannot acknowledge",
            channel
                .link
                .channel
                .basic_ack(BasicAckArguments::new(tag, true)),
        )
        .await;
        match acked {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(error = %e, tag, "cannot acknowledge a message; it comes again");
                false
            }
        }
    }

    /// Publishes `properties` and `msg`'s body to queue `queue` through the default exchange
    /// and waits until the server confirmed it, trying again (after the outage backoff) while
    /// it is refused; `false` if the channel closed or `cancel` fired first (the original is
    /// then not acknowledged: it comes again). `what` names it in messages.
    async fn forward(
        &self,
        msg: &Received,
        queue: &str,
        properties: BasicProperties,
        what: &str,
    ) -> bool {
        let mut failures = 0u32;
        let mut blocked: Option<metrics::Gauge> = None;
        loop {
            let published = {
                let mut guard = self.channel.lock().await;
                let Some(channel) = guard.as_mut().filter(|c| c.is_open()) else {
                    return false;
                };
                channel
                    .publish(
                        "",
                        queue,
                        properties.clone(),
                        msg.body.clone(),
                        ANSWER_WITHIN,
                    )
                    .await
            };
            let outcome = match published {
                Ok(confirmed) => confirm::outcome(confirmed).await,
                Err(_) => return false,
            };
            if outcome == Outcome::Published {
                break;
            }
            failures += 1;
            if blocked.is_none() {
                tracing::error!(queue, outcome = ?outcome,
                    "cannot publish a message to its {what} queue (does it exist? may this consumer \
                     publish to it?); the shard's reading waits until it can");
                let gauge =
                    metrics::gauge!("outbox_consumer_forward_blocked", "topic" => queue.to_owned());
                gauge.set(1.0);
                blocked = Some(gauge);
            }
            if self.rabbitmq.declare {
                let guard = self.channel.lock().await;
                if let Some(channel) = guard.as_ref() {
                    let _ = self
                        .topology()
                        .declare(&channel.link.channel, self.shard, ANSWER_WITHIN)
                        .await;
                }
            }
            let wait = self.shared.settings.outage_backoff(failures);
            tokio::select! {
                () = self.cancel.cancelled() => return false,
                () = tokio::time::sleep(wait) => {}
            }
        }
        if let Some(gauge) = blocked {
            gauge.set(0.0);
            tracing::info!(queue, "the {what} queue takes messages again; consuming");
        }
        true
    }

    fn source(&self) -> wire::Source<'_> {
        wire::Source {
            topic: &self.topic,
            group: self.shared.settings.group(),
            shard: self.shard,
        }
    }
}

impl Reading for Reader {
    type Message = Received;

    fn check<'m>(&self, msg: &'m Received) -> Checked<'m> {
        let delivered = Delivered {
            topic: &msg.topic,
            partition: i32::from(self.shard),
            offset: 0,
            key: msg.decoded.key.as_deref(),
            payload: &msg.body,
        };
        let headers = msg
            .decoded
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), Some(value.as_slice())));
        let mut incoming = message::check(delivered, headers)?;
        incoming.meta.attempt = incoming.meta.attempt.saturating_add(msg.decoded.returned);
        Ok(incoming)
    }

    fn failed_before(&self, msg: &Received) -> u32 {
        let retried = msg
            .decoded
            .headers
            .iter()
            .find(|(name, _)| name == message::headers::ATTEMPTS)
            .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u32>().ok())
            .unwrap_or(0);
        retried.saturating_add(msg.decoded.returned)
    }

    /// Acknowledges what committed; a message to retry is first published to the shard's
    /// delay queue (expiring when due), a dead letter to the dead-letter queue, each confirmed
    /// before the original is acknowledged.
    async fn settle(
        &self,
        done: &[Received],
        failed: Vec<Option<(Destination, String)>>,
        _cancel: &CancellationToken,
    ) -> bool {
        let from = self.source();
        for (msg, failed) in done.iter().zip(failed) {
            match failed {
                None => {}
                Some((Destination::Retry { attempts, due_ms }, reason)) => {
                    let delay = u64::try_from(due_ms - message::now_ms()).unwrap_or(0);
                    let properties = wire::retry(
                        msg.properties.as_ref(),
                        &from,
                        &reason,
                        attempts,
                        due_ms,
                        delay,
                    );
                    let queue = self.topology().delay_queue(self.shard);
                    if !self.forward(msg, &queue, properties, "delay").await {
                        return false;
                    }
                    metrics::counter!("outbox_consumer_retried_total").increment(1);
                    tracing::info!(topic = %self.topic, shard = self.shard, attempts, reason,
                        "handler failed; retried after its backoff through the delay queue");
                }
                Some((Destination::DeadLetter { attempts }, reason)) => {
                    let properties =
                        wire::dead_letter(msg.properties.as_ref(), &from, &reason, attempts);
                    if !self
                        .forward(msg, &self.dead_letters, properties, "dead-letter")
                        .await
                    {
                        return false;
                    }
                    metrics::counter!("outbox_consumer_dead_lettered_total").increment(1);
                    tracing::warn!(topic = %self.topic, shard = self.shard, reason, "message dead-lettered");
                }
            }
        }
        // One acknowledgement for the whole run of messages (they are contiguous, and what
        // came before them on this channel is settled).
        match done.last() {
            Some(last) => self.ack_up_to(last.tag).await,
            None => true,
        }
    }
}

/// A message off a shard queue, its headers read as the Kafka consumer reads a record's.
pub(super) struct Received {
    /// The topic it was published to (its shard queue's).
    topic: Arc<str>,
    tag: u64,
    properties: Option<BasicProperties>,
    body: Vec<u8>,
    decoded: Decoded,
}

impl Received {
    /// `None` for what is not a delivery (the client hands only deliveries here).
    fn new(topic: &Arc<str>, message: ConsumerMessage) -> Option<Received> {
        let deliver = message.deliver?;
        let decoded = wire::decode(message.basic_properties.as_ref());
        Some(Received {
            topic: Arc::clone(topic),
            tag: deliver.delivery_tag(),
            properties: message.basic_properties,
            body: message.content.unwrap_or_default(),
            decoded,
        })
    }
}
