//! Consuming from NATS JetStream: a durable pull consumer per topic, its batches handled as
//! Kafka's are ([`batch`](super::batch) in dedup mode, [`receive`](crate::inbox::receive) in inbox mode), each message
//! acknowledged only once the database committed it; a retryable failure redelivered by the
//! server once its backoff has passed (`nak` with a delay); a dead letter published to
//! `<topic>.dlq`, stored by its stream, and only then terminated.
//!
//! Per-key order (dedup mode): one instance of a group reads a topic at a time, under its
//! [`Lease`], and handles its batches one after the other. What a crashed or stalled instance
//! held stays pending until `ack_wait` and is redelivered before anything newer (the server
//! serves redeliveries first; the successor waits for them to be due, takes them all and
//! sorts them into the stream's order: the server redelivers in the order the waits ran out).
//! Only a retry moves a message back (after its key's later messages), as the retry topic does
//! on Kafka.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use super::received::Received;
use super::settings::JetStream;
use super::streams::{durable_name, stream_for, Lookup, StreamSpec, DUPLICATE_WINDOW};
use crate::error::{Error, Result};
use crate::inbox::batch::{Checked, Fence};
use crate::inbox::failure::Destination;
use crate::inbox::lease::Lease;
use crate::inbox::message;
use crate::inbox::settings::{Mode, Settings};
use crate::inbox::shared::Shared;
use crate::inbox::source::{Reading, Reads, Source};
use crate::inbox::{dedup, receive};
use crate::publish::Boxed;

mod settle;

/// A consumer's JetStream.
struct Consumer {
    jetstream: JetStream,
}

/// The source a consumer reads from JetStream through (its settings checked by the builder).
pub(crate) fn source(jetstream: &JetStream, _settings: &Settings) -> Box<dyn Source> {
    Box::new(Consumer {
        jetstream: jetstream.clone(),
    })
}

impl Source for Consumer {
    fn consume<'a>(
        &'a self,
        shared: &'a Arc<Shared>,
        cancel: &'a CancellationToken,
    ) -> Boxed<'a, Result<()>> {
        Box::pin(consume(shared, &self.jetstream, cancel))
    }
}

/// Batches the server may deliver ahead of the one being handled (`max_ack_pending` is this
/// many batch sizes).
const AHEAD: usize = 4;

/// How long a session that starts with messages delivered before waits for the next of them
/// before it handles what it has (those still missing are retries not due yet).
const REDELIVERIES_QUIET: Duration = Duration::from_millis(250);

/// How long the server gets to answer a request of the consumer's (a lookup, a publish).
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// Consumes every handled topic, each from its own durable consumer, until `cancel` fires.
async fn consume(
    shared: &Arc<Shared>,
    jetstream: &JetStream,
    cancel: &CancellationToken,
) -> Result<()> {
    let context = jetstream::ContextBuilder::new()
        .timeout(ANSWER_WITHIN)
        .build(jetstream.client.clone());
    let mut readers = tokio::task::JoinSet::new();
    for topic in shared.routes.topics() {
        let settings = &shared.settings;
        // One instance of a group reads a topic at a time, in either mode: in dedup mode so
        // that handlers run in the stream's order, in inbox mode so that rows are stored in it
        // (their `seq`: the processors' order within a key).
        let lease = Some(Lease::new(
            shared.db.clone(),
            settings.group(),
            &topic,
            jetstream.ack_wait,
        ));
        let reader = Reader {
            shared: Arc::clone(shared),
            jetstream: jetstream.clone(),
            context: context.clone(),
            topic,
            lease,
            cancel: cancel.clone(),
        };
        readers.spawn(reader.run());
    }
    while let Some(joined) = readers.join_next().await {
        if let Err(source) = joined {
            cancel.cancel();
            return Err(Error::Task {
                task: "a JetStream topic's reader",
                source,
            });
        }
    }
    Ok(())
}

/// One topic's reader.
struct Reader {
    shared: Arc<Shared>,
    jetstream: JetStream,
    context: jetstream::Context,
    topic: String,
    /// The group's lease on the topic, which this instance must own to read it.
    lease: Option<Lease>,
    cancel: CancellationToken,
}

/// Why a reading session ended.
enum Ended {
    /// `cancel` fired.
    Cancelled,
    /// The lease lapsed: another instance may read now.
    Lapsed,
    /// The stream is missing, or the server did not answer.
    Failed(Lookup),
    /// The messages stopped (the server went away); whether a batch was handled.
    Stopped { handled: bool },
}

impl Reader {
    /// Reads until `cancel` fires: waits for the group's lease, then opens the
    /// durable consumer (while its stream is missing or the server away, says so and tries
    /// again) and reads it until it fails or the lease lapses.
    async fn run(self) {
        let mut failures = 0u32;
        let missing =
            metrics::gauge!("outbox_consumer_missing_topic", "topic" => self.topic.clone());
        loop {
            if let Some(lease) = &self.lease {
                if lease.acquire(&self.cancel).await.is_none() {
                    return;
                }
            }
            let stop = CancellationToken::new();
            let session = async {
                let ended = self.session().await;
                stop.cancel();
                ended
            };
            let keeping = async {
                if let Some(lease) = &self.lease {
                    lease.keep(&stop).await;
                }
            };
            let (ended, ()) = tokio::join!(session, keeping);
            match ended {
                Ended::Cancelled => {
                    if let Some(lease) = &self.lease {
                        lease.release().await;
                    }
                    return;
                }
                Ended::Lapsed => continue,
                Ended::Stopped { handled } => {
                    missing.set(0.0);
                    if handled {
                        failures = 0;
                    }
                }
                Ended::Failed(Lookup::Missing) => {
                    missing.set(1.0);
                    if failures == 0 {
                        tracing::warn!(topic = %self.topic, group = %self.shared.settings.group(),
                            "no JetStream stream captures the consumer's subject `{}`: waiting \
                             for one (create it, or let the consumer: JetStream::create_streams)",
                            self.topic);
                    }
                }
                Ended::Failed(Lookup::Failed(e)) => {
                    if failures == 0 {
                        tracing::warn!(topic = %self.topic, error = %e, "cannot read from JetStream; trying again");
                    } else {
                        tracing::debug!(topic = %self.topic, error = %e, "cannot read from JetStream; trying again");
                    }
                }
            }
            failures += 1;
            let wait = self.shared.settings.outage_backoff(failures);
            tokio::select! {
                () = self.cancel.cancelled() => {
                    if let Some(lease) = &self.lease {
                        lease.release().await;
                    }
                    return;
                }
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Opens the durable consumer and reads it until it stops, `cancel` fires or the lease
    /// lapses. If messages delivered before are not settled (another instance's,
    /// crashed or stopped with messages fetched beyond its last batch; an earlier session's;
    /// retries waiting for their redelivery), first waits until they are due again, so that
    /// they come before anything newer (the server serves redeliveries first).
    async fn session(&self) -> Ended {
        let consumer = match self.open().await {
            Ok(consumer) => consumer,
            Err(e) => return Ended::Failed(e),
        };
        let mut pending = 0;
        if self.lease.is_some() {
            let mut consumer = consumer.clone();
            pending = consumer.info().await.map_or(1, |i| i.num_ack_pending);
            if pending > 0 {
                let wait = self.jetstream.ack_wait + self.jetstream.ack_wait / 10;
                tracing::info!(topic = %self.topic, pending, ?wait,
                    "messages delivered before are not settled: reading once they are due again");
                tokio::select! {
                    () = self.cancel.cancelled() => return Ended::Cancelled,
                    () = self.lapsed() => return Ended::Lapsed,
                    () = tokio::time::sleep(wait) => {}
                }
            }
        }
        let messages = consumer
            .stream()
            .max_messages_per_batch(self.shared.settings.batch_size)
            .messages()
            .await;
        match messages {
            Ok(mut messages) => self.read(&mut messages, pending).await,
            Err(e) => Ended::Failed(Lookup::Failed(format!(
                "cannot pull messages: {}",
                crate::error_chain(&e)
            ))),
        }
    }

    /// Returns once the lease lapsed (never without one).
    async fn lapsed(&self) {
        match &self.lease {
            Some(lease) => lease.lapsed().await,
            None => std::future::pending().await,
        }
    }

    /// The group's durable consumer of the topic (created, or its settings updated).
    async fn open(&self) -> std::result::Result<PullConsumer, Lookup> {
        let settings = &self.shared.settings;
        let failed = |what: &str, e: &(dyn std::error::Error + 'static)| {
            Lookup::Failed(format!("{what}: {}", crate::error_chain(e)))
        };
        let name = stream_for(&self.context, &self.topic, self.create_streams()).await?;
        let stream = self
            .context
            .get_stream_no_info(&name)
            .await
            .map_err(|e| failed("cannot find the stream", &e))?;
        let config = pull::Config {
            durable_name: Some(durable_name(settings.group(), &self.topic)),
            description: Some(format!(
                "outbox consumer group `{}` of `{}`",
                settings.group(),
                self.topic
            )),
            filter_subject: self.topic.clone(),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.jetstream.ack_wait,
            // The consumer dead-letters a message itself, after `max_attempts`.
            max_deliver: -1,
            // The batch in hand and a few being fetched meanwhile.
            max_ack_pending: (settings.batch_size * AHEAD) as i64,
            ..Default::default()
        };
        stream
            .create_consumer(config)
            .await
            .map_err(|e| failed("cannot create the durable consumer", &e))
    }

    /// With `create_streams`, how the consumer creates a missing stream.
    fn create_streams(&self) -> Option<StreamSpec> {
        self.jetstream.create_streams.then_some(StreamSpec {
            replicas: self.jetstream.replicas,
            duplicate_window: DUPLICATE_WINDOW,
        })
    }

    /// Reads batches until the messages stop, `cancel` fires (after the batch in hand) or the
    /// lease lapses (a batch in hand is then given up: nothing of it settled, it comes again).
    /// While a batch is handled, the next one is read (up to a batch): the server keeps
    /// delivering meanwhile (the stream asks it for more only while it is read), and the next
    /// batch starts at once. A batch's messages all came before the next one's: the stream's
    /// order is kept.
    ///
    /// The server delivers again what was not acknowledged in time in the order the waits ran
    /// out, so a message delivered again and left unacknowledged once more (sessions ending
    /// one after another) comes back behind the others. A session that starts with `pending`
    /// messages delivered before therefore takes them all (or what comes of them until a new
    /// message does, or nothing more for [`REDELIVERIES_QUIET`]: retries not due yet) and
    /// handles them in the stream's order, a batch at a time.
    async fn read(&self, messages: &mut pull::Stream, pending: usize) -> Ended {
        let batch_size = self.shared.settings.batch_size;
        let mut handled = false;
        let mut gathering = pending > 0;
        let mut tick = self.progress_ticks();
        // What was read while the batch before was handled: the next batch's start.
        let mut ahead: Vec<Received> = Vec::with_capacity(batch_size);
        // The messages stopped (the server went away) while a batch was handled.
        let mut stopped = false;
        loop {
            // Told to stop: the batch in hand was the last. What was read ahead is not settled
            // (it comes again, to this group's next reader).
            if self.cancel.is_cancelled() {
                return Ended::Cancelled;
            }
            while ahead.is_empty() {
                if stopped {
                    return Ended::Stopped { handled };
                }
                let next = tokio::select! {
                    () = self.cancel.cancelled() => return Ended::Cancelled,
                    () = self.lapsed() => return Ended::Lapsed,
                    next = messages.next() => next,
                };
                stopped = self.pulled(next, &mut ahead);
            }
            if std::mem::take(&mut gathering) {
                // One message a pull, and the gathering ends at the first new one: until then
                // every message in `ahead` was delivered before.
                loop {
                    let fresh = ahead.last().is_some_and(|m| m.delivered == 1);
                    if stopped || fresh || ahead.len() >= pending {
                        break;
                    }
                    let next = tokio::select! {
                        () = self.cancel.cancelled() => return Ended::Cancelled,
                        () = self.lapsed() => return Ended::Lapsed,
                        next = tokio::time::timeout(REDELIVERIES_QUIET, messages.next()) => next,
                    };
                    match next {
                        Ok(next) => stopped = self.pulled(next, &mut ahead),
                        Err(_) => break,
                    }
                }
                ahead.sort_by_key(|m| m.sequence);
            }
            // Whatever else has arrived, up to a batch.
            while !stopped && ahead.len() < batch_size {
                match tokio::time::timeout(Duration::ZERO, messages.next()).await {
                    Ok(next) => stopped = self.pulled(next, &mut ahead),
                    Err(_) => break,
                }
            }
            let rest = ahead.split_off(ahead.len().min(batch_size));
            let batch = std::mem::replace(&mut ahead, rest);
            let handling = async {
                match self.shared.settings.mode {
                    Mode::Dedup => {
                        dedup::handle_batch(&self.shared, self, &batch, &self.cancel).await
                    }
                    Mode::Inbox => {
                        receive::receive_batch(&self.shared, self, &batch, &self.cancel).await
                    }
                }
            };
            let lapsed = self.lapsed();
            tokio::pin!(handling, lapsed);
            // What is read meanwhile waits for the batch: the server is told it is worked on,
            // as the batch's own messages are, or it delivers it again after `ack_wait` (a
            // copy that would come behind later messages of its key). One clock for the whole
            // session: what was gathered at its start waits through several batches.
            let done = loop {
                tokio::select! {
                    biased;
                    done = &mut handling => break done,
                    () = &mut lapsed => return Ended::Lapsed,
                    _ = tick.tick(), if !ahead.is_empty() && self.may_report() => {
                        Self::report_progress(&ahead).await;
                    }
                    next = messages.next(), if !stopped && ahead.len() < batch_size => {
                        stopped = self.pulled(next, &mut ahead);
                    }
                }
            };
            if !done {
                return if self.cancel.is_cancelled() {
                    Ended::Cancelled
                } else {
                    Ended::Lapsed // the fence found the lease gone
                };
            }
            handled = true;
        }
    }

    /// Adds what the stream gave to `ahead`; `true` if it says the messages stopped (the
    /// server went away, or the consumer with it: it is to be opened again). A failed pull is
    /// logged and passed over.
    fn pulled(
        &self,
        next: Option<std::result::Result<jetstream::Message, pull::MessagesError>>,
        ahead: &mut Vec<Received>,
    ) -> bool {
        use pull::MessagesErrorKind as Kind;
        match next {
            None => true,
            Some(Ok(message)) => {
                ahead.push(Received::new(message));
                false
            }
            Some(Err(e)) => {
                let e_text = crate::error_chain(&e).to_string();
                match e.kind() {
                    Kind::MissingHeartbeat | Kind::ConsumerDeleted | Kind::NoResponders => {
                        tracing::info!(topic = %self.topic, error = %e_text, "the JetStream consumer stopped; opening it again");
                        true
                    }
                    _ => {
                        tracing::debug!(topic = %self.topic, error = %e_text, "a pull failed");
                        false
                    }
                }
            }
        }
    }

    /// Awaits `future` while telling the server, every third of `ack_wait`, that `messages` are
    /// still being worked on (so that it does not deliver them again meanwhile).
    async fn working_on<F: std::future::Future>(
        &self,
        messages: &[Received],
        future: F,
    ) -> F::Output {
        tokio::pin!(future);
        let mut tick = self.progress_ticks();
        loop {
            tokio::select! {
                out = &mut future => return out,
                _ = tick.tick(), if self.may_report() => Self::report_progress(messages).await,
            }
        }
    }

    /// When to tell the server that the messages held are still worked on: every third of
    /// `ack_wait`, the first a third from now.
    fn progress_ticks(&self) -> tokio::time::Interval {
        let every = self.jetstream.ack_wait / 3;
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        // A tick missed between batches comes once, as soon as it can.
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks
    }

    /// Whether this reader may keep messages from coming again: not once its lease lapsed.
    fn may_report(&self) -> bool {
        self.lease.as_ref().is_none_or(Lease::is_valid)
    }

    /// Tells the server that `messages` are still worked on (it waits `ack_wait` again).
    async fn report_progress(messages: &[Received]) {
        for msg in messages {
            msg.settle(AckKind::Progress).await;
        }
    }
}

impl Reads for JetStream {
    fn source(&self, settings: &Settings) -> Result<Box<dyn Source>> {
        Ok(source(self, settings))
    }
}
