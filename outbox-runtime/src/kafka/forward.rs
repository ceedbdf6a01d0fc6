//! Sending a message on: to its retry topic after a retryable failure, to its dead-letter topic
//! for good. Each send is acknowledged (`acks=all`) before the message's offset is stored. A
//! topic that is missing, or refuses, stops consumption until it takes the message: the
//! consumer pauses its partitions and keeps polling, so it stays in its group, and says why.

use std::time::Duration;

use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use super::poll::rewind;
use crate::config::Backoff;
use crate::error::{Error, Result};
use crate::inbox::failure::Destination;
use crate::inbox::message::{headers, Origin};
use crate::inbox::settings::{Settings, Topics};

/// Every header the consumer sets on a retried message (replaced, not repeated, on the next
/// retry).
const RETRY_HEADERS: [&str; 6] = [
    headers::SOURCE_TOPIC,
    headers::SOURCE_PARTITION,
    headers::SOURCE_OFFSET,
    headers::ATTEMPTS,
    headers::DUE_MS,
    headers::ERROR,
];

/// `cancel` fired before the message was sent: its offset must stay unstored.
#[derive(Debug)]
pub(crate) struct Cancelled;

/// The consumer while a send to `topic` is blocked: every partition paused, still polling (so
/// it stays in its group), the `outbox_consumer_forward_blocked` gauge at 1. Dropping it
/// resumes every partition it paused, assigned or not: librdkafka keeps an application's pause
/// across a rebalance, so a partition revoked meanwhile and assigned again later would
/// otherwise never be fetched again.
struct Blocked<'c> {
    consumer: &'c StreamConsumer,
    paused: TopicPartitionList,
    gauge: metrics::Gauge,
}

impl<'c> Blocked<'c> {
    fn new(consumer: &'c StreamConsumer, topic: &str) -> Self {
        let paused = consumer.assignment().unwrap_or_default();
        if let Err(e) = consumer.pause(&paused) {
            tracing::debug!(error = %crate::error_chain(&e), "cannot pause the assignment");
        }
        let gauge = metrics::gauge!("outbox_consumer_forward_blocked", "topic" => topic.to_owned());
        gauge.set(1.0);
        Blocked {
            consumer,
            paused,
            gauge,
        }
    }

    /// Awaits `future` while polling: a message still comes from a partition assigned
    /// meanwhile, which is then paused and rewound (and resumed with the others). `None` if `cancel` fires
    /// first.
    async fn polling<F: std::future::Future>(
        &mut self,
        future: F,
        cancel: &CancellationToken,
    ) -> Option<F::Output> {
        tokio::pin!(future);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return None,
                out = &mut future => return Some(out),
                polled = self.consumer.recv() => {
                    if let Ok(msg) = polled {
                        rewind(self.consumer, &msg);
                        self.paused.add_partition(msg.topic(), msg.partition());
                    }
                }
            }
        }
    }
}

impl Drop for Blocked<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.consumer.resume(&self.paused) {
            tracing::debug!(error = %crate::error_chain(&e), "cannot resume a partition");
        }
        self.gauge.set(0.0);
    }
}

/// A message to send on, and why.
pub(crate) struct Forward<'a, 'm> {
    pub msg: &'a BorrowedMessage<'m>,
    /// Where it was first read: its own topic (its handlers are routed by it), partition and
    /// offset, or those of the message it was retried from.
    pub origin: Origin<'a>,
    pub destination: Destination,
    pub reason: String,
}

impl Forward<'_, '_> {
    fn kind(&self) -> &'static str {
        match self.destination {
            Destination::Retry { .. } => "retry",
            Destination::DeadLetter { .. } => "dead-letter",
        }
    }

    /// Its key, value and headers (the consumer's own replaced), and the consumer's headers.
    fn headers(&self) -> OwnedHeaders {
        let mut out = OwnedHeaders::new();
        if let Some(h) = self.msg.headers() {
            for header in h.iter().filter(|h| !RETRY_HEADERS.contains(&h.key)) {
                out = out.insert(header);
            }
        }
        let ours: Vec<(&str, String)> = match self.destination {
            Destination::Retry { attempts, due_ms } => vec![
                (headers::SOURCE_TOPIC, self.origin.topic.to_owned()),
                (headers::SOURCE_PARTITION, self.origin.partition.to_string()),
                (headers::SOURCE_OFFSET, self.origin.offset.to_string()),
                (headers::ATTEMPTS, attempts.to_string()),
                (headers::DUE_MS, due_ms.to_string()),
                (headers::ERROR, self.reason.clone()),
            ],
            Destination::DeadLetter { attempts } => vec![
                (headers::DLQ_ERROR, self.reason.clone()),
                (headers::DLQ_ATTEMPTS, attempts.to_string()),
                (headers::DLQ_SOURCE_TOPIC, self.origin.topic.to_owned()),
                (
                    headers::DLQ_SOURCE_PARTITION,
                    self.origin.partition.to_string(),
                ),
                (headers::DLQ_SOURCE_OFFSET, self.origin.offset.to_string()),
            ],
        };
        for (key, value) in &ours {
            out = out.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        out
    }

    fn record<'r>(&'r self, topic: &'r str) -> FutureRecord<'r, [u8], [u8]> {
        let mut record = FutureRecord::to(topic).headers(self.headers());
        if let Some(key) = self.msg.key() {
            record = record.key(key);
        }
        if let Some(payload) = self.msg.payload() {
            record = record.payload(payload);
        }
        record
    }

    fn delivered(&self) {
        let msg = self.msg;
        match self.destination {
            Destination::Retry { attempts, .. } => {
                metrics::counter!("outbox_consumer_retried_total").increment(1);
                tracing::info!(topic = msg.topic(), partition = msg.partition(),
                    offset = msg.offset(), attempts, reason = %self.reason,
                    "message sent to its retry topic");
            }
            Destination::DeadLetter { .. } => {
                metrics::counter!("outbox_consumer_dead_lettered_total").increment(1);
                tracing::warn!(topic = msg.topic(), partition = msg.partition(),
                    offset = msg.offset(), reason = %self.reason, "message dead-lettered");
            }
        }
    }
}

/// Sends failed messages on to their retry and dead-letter topics, on a producer of its own
/// (idempotent, `acks=all`).
pub(crate) struct Forwarder {
    producer: FutureProducer,
    topics: Topics,
    backoff: Backoff,
}

impl Forwarder {
    /// The producer it sends with.
    pub(crate) fn producer(&self) -> &FutureProducer {
        &self.producer
    }

    /// Creates the producer, with `config`, for a consumer with `settings`.
    pub(crate) fn new(config: ClientConfig, settings: &Settings) -> Result<Forwarder> {
        let producer = config.create().map_err(|source| Error::KafkaClient {
            client: "retry and dead-letter producer",
            source,
        })?;
        Ok(Forwarder {
            producer,
            topics: settings.topics.clone(),
            backoff: settings.backoff,
        })
    }

    fn destination_topic(&self, item: &Forward<'_, '_>) -> String {
        match item.destination {
            Destination::Retry { attempts, .. } => {
                retry_topic(&self.topics, item.origin.topic, attempts)
            }
            Destination::DeadLetter { .. } => self.topics.dead_letter(item.origin.topic),
        }
    }

    /// Sends the messages on, all at once, and returns once the broker acknowledged each;
    /// one that fails is sent again by [`forward`](Self::forward). `Err` only when `cancel`
    /// fires first.
    pub(crate) async fn forward_all(
        &self,
        consumer: &StreamConsumer,
        items: &[Forward<'_, '_>],
        cancel: &CancellationToken,
    ) -> std::result::Result<(), Cancelled> {
        // Queued together, they share the producer's requests.
        let pending: Vec<_> = items
            .iter()
            .map(|item| {
                let topic = self.destination_topic(item);
                self.producer.send_result(item.record(&topic)).ok()
            })
            .collect();
        for (item, delivery) in items.iter().zip(pending) {
            let delivered = match delivery {
                Some(delivery) => matches!(delivery.await, Ok(Ok(_))),
                None => false,
            };
            if delivered {
                item.delivered();
            } else {
                self.forward(consumer, item, cancel).await?;
            }
        }
        Ok(())
    }

    /// Sends the message on and returns once the broker acknowledged it; until then (a
    /// missing topic, say) consumption waits, polling. `Err` only when `cancel` fires first.
    pub(crate) async fn forward(
        &self,
        consumer: &StreamConsumer,
        item: &Forward<'_, '_>,
        cancel: &CancellationToken,
    ) -> std::result::Result<(), Cancelled> {
        let topic = self.destination_topic(item);
        let kind = item.kind();
        let mut blocked: Option<Blocked<'_>> = None;
        let mut failures = 0u32;
        loop {
            let send = self
                .producer
                .send(item.record(&topic), Duration::from_secs(30));
            let sent = match blocked.as_mut() {
                None => send.await,
                // Once blocked, poll while waiting, so the consumer stays in its group.
                Some(b) => b.polling(send, cancel).await.ok_or(Cancelled)?,
            };
            match sent {
                Ok(_) => {
                    if blocked.take().is_some() {
                        tracing::info!(topic = %topic, "the {kind} topic takes messages again; consuming");
                    }
                    item.delivered();
                    return Ok(());
                }
                Err((e, _)) => {
                    failures += 1;
                    let b = blocked.get_or_insert_with(|| {
                        tracing::error!(error = %crate::error_chain(&e), topic = %topic,
                            "cannot send a message to its {kind} topic (does it exist? may this \
                             consumer write to it?); consumption waits until it can");
                        Blocked::new(consumer, &topic)
                    });
                    let wait = tokio::time::sleep(self.backoff.jittered(failures));
                    b.polling(wait, cancel).await.ok_or(Cancelled)?;
                }
            }
        }
    }
}

/// The topics a consumer may send messages of `handled` topics to, each with its source
/// topic and role (`retry` or `dead_letter`): every source's dead-letter topic, and in
/// dedup mode with retry topics, its retry topics.
pub(crate) fn forward_topics(
    settings: &Settings,
    handled: &[String],
) -> Vec<(String, String, &'static str)> {
    let retries = settings.retries_through_topics();
    let topics = &settings.topics;
    handled
        .iter()
        .flat_map(|source| {
            let retry = (1..=topics.retry_tiers)
                .filter(move |_| retries)
                .map(move |tier| (retry_topic(topics, source, tier), source.clone(), "retry"));
            retry.chain(std::iter::once((
                topics.dead_letter(source),
                source.clone(),
                "dead_letter",
            )))
        })
        .collect()
}

/// The retry topic of source topic `source` for a message that failed `attempts` times.
pub(crate) fn retry_topic(topics: &Topics, source: &str, attempts: u32) -> String {
    if topics.retry_tiers == 1 {
        format!("{source}{}", topics.retry_suffix)
    } else {
        let tier = attempts.clamp(1, topics.retry_tiers);
        format!("{source}{}-{tier}", topics.retry_suffix)
    }
}
