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
//! included once it has connected again. A message that goes back a second time lands behind
//! the others that went back: a session reading what came back puts a key's messages back in
//! order (`consumer/returns.rs`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use amqprs::channel::{
    BasicAckArguments, BasicCancelArguments, BasicConsumeArguments, BasicQosArguments,
    BasicRejectArguments, ConsumerMessage,
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

mod returns;
mod settle;

use returns::{Next, Returns};

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
                defer: std::sync::atomic::AtomicBool::new(false),
                deferred: std::sync::atomic::AtomicU64::new(0),
                returns: std::sync::Mutex::default(),
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
    /// Set while the careful consumer's last message is handled: its acknowledgement waits
    /// (in `deferred`) until that consumer is cancelled (see [`Reader::widen`]).
    defer: std::sync::atomic::AtomicBool,
    deferred: std::sync::atomic::AtomicU64,
    /// What the session's careful consumer did with the returns it took.
    returns: std::sync::Mutex<Returns>,
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
        let (careful, mut deliveries) = match self.subscribe(&channel.link.channel, 1).await {
            Ok(subscribed) => subscribed,
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
        self.read(&careful, &mut deliveries).await
    }

    /// This shard's queue.
    fn queue(&self) -> String {
        self.topology().shard_queue(self.shard)
    }

    /// Sets the prefetch of the consumers subscribed next on `amqp` to `prefetch` messages
    /// (see [`read`](Self::read)) and subscribes to the shard queue; returns the consumer's tag
    /// and its deliveries.
    async fn subscribe(
        &self,
        amqp: &amqprs::channel::Channel,
        prefetch: u16,
    ) -> std::result::Result<(String, UnboundedReceiver<ConsumerMessage>), String> {
        let settings = &self.shared.settings;
        super::link::timed(
            ANSWER_WITHIN,
            "cannot set the prefetch",
            amqp.basic_qos(BasicQosArguments::new(0, prefetch, false)),
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
        let (tag, deliveries) = super::link::timed(
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
        Ok((tag, deliveries))
    }

    /// Whether the session's channel is still open.
    async fn open(&self) -> bool {
        self.channel
            .lock()
            .await
            .as_ref()
            .is_some_and(Confirming::is_open)
    }

    /// Widens the prefetch to two batches. RabbitMQ applies a prefetch to the consumers
    /// subscribed after it is set, so a wide consumer is subscribed and the careful one
    /// (`careful`) cancelled. The careful one's last message (`held`, 0 if none) is still
    /// unacknowledged, so that nothing more was delivered to it (prefetch 1); it is
    /// acknowledged once the careful consumer is cancelled, when whichever consumer is active
    /// next (this session's wide one, or another instance's) may receive the next message:
    /// its effect committed before. Returns the wide consumer's deliveries.
    async fn widen(&self, careful: &str, held: u64) -> Option<UnboundedReceiver<ConsumerMessage>> {
        let prefetch = u16::try_from(self.shared.settings.batch_size * 2).unwrap_or(u16::MAX);
        let wide = {
            let guard = self.channel.lock().await;
            let amqp = &guard.as_ref()?.link.channel;
            let (_, wide) = self.subscribe(amqp, prefetch).await.ok()?;
            super::link::timed(
                ANSWER_WITHIN,
                "cannot cancel the careful consumer",
                amqp.basic_cancel(BasicCancelArguments::new(careful)),
            )
            .await
            .ok()?;
            wide
        };
        if held != 0 && !self.ack_up_to(held).await {
            return None;
        }
        Some(wide)
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
    async fn read(
        &self,
        careful_tag: &str,
        deliveries: &mut UnboundedReceiver<ConsumerMessage>,
    ) -> Ended {
        let batch_size = self.shared.settings.batch_size;
        let mut careful = true;
        let mut handled = false;
        *self.returns() = Returns::default();
        let mut check = tokio::time::interval(CHECK_EVERY);
        // After a long batch, one check, not one for each second it took.
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // In this order: told to stop, it takes no other batch however long the backlog,
            // and the channel is checked however busy it is.
            let first = tokio::select! {
                biased;
                () = self.cancel.cancelled() => return Ended::Cancelled,
                _ = check.tick() => {
                    if self.open().await {
                        continue;
                    }
                    None
                }
                next = deliveries.recv() => next,
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
            if let (true, [msg]) = (careful, batch.as_slice()) {
                if self.ahead_of_its_key(msg).await {
                    if !self.send_back(msg.tag).await {
                        return Ended::Lost {
                            error: Some("the channel closed while a message was sent back".into()),
                            handled,
                        };
                    }
                    continue;
                }
            }
            // The careful consumer's first message no consumer held before: the last it takes.
            let last_careful = careful && batch.iter().all(|m| m.decoded.returned == 0);
            self.defer.store(last_careful, Ordering::SeqCst);
            self.deferred.store(0, Ordering::SeqCst);
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
            if careful {
                let mut returns = self.returns();
                for msg in &batch {
                    returns.settled(&msg.decoded);
                }
            }
            if last_careful {
                self.defer.store(false, Ordering::SeqCst);
                let held = self.deferred.swap(0, Ordering::SeqCst);
                let Some(wide) = self.widen(careful_tag, held).await else {
                    return Ended::Lost {
                        error: Some("cannot widen the prefetch".into()),
                        handled,
                    };
                };
                *deliveries = wide;
                careful = false;
            }
        }
    }
}

impl Reader {
    /// Whether returned message `msg` goes back behind the returns (see `returns.rs`), asking
    /// the database whether it holds its predecessor if that decides it.
    async fn ahead_of_its_key(&self, msg: &Received) -> bool {
        let decoded = &msg.decoded;
        // A message the server is about to dead-letter for its returns is not sent back.
        let limit = u32::try_from(super::topology::DELIVERY_LIMIT - 1).unwrap_or(u32::MAX);
        if decoded.returned == 0 || decoded.returned >= limit {
            return false;
        }
        let next = self.returns().next(decoded);
        let back = match next {
            Next::Handle => false,
            Next::SendBack => true,
            Next::AskFor(previous) => tokio::select! {
                () = self.cancel.cancelled() => false,
                held = self.shared.holds(previous) => match held {
                    Ok(held) => !held,
                    Err(e) => {
                        // Handling it would fail the same way, and is waited out there.
                        tracing::debug!(error = %crate::error_chain(&e),
                            "cannot look up a message's predecessor");
                        false
                    }
                },
            },
        };
        if back {
            self.returns().sent_back(decoded);
        }
        back
    }

    /// The session's returns (see `returns.rs`).
    fn returns(&self) -> std::sync::MutexGuard<'_, Returns> {
        self.returns.lock().unwrap_or_else(|e| e.into_inner())
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
