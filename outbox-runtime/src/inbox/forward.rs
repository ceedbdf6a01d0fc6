//! Sending a message on: to its retry topic after a retryable failure, to its dead-letter topic
//! for good. Each send is acknowledged (`acks=all`) before the message's offset is stored. A
//! topic that is missing, or refuses, stops consumption until it takes the message: the
//! consumer pauses its partitions and keeps polling, so it stays in its group, and says why.

use std::time::Duration;

use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use super::consumer::Inner;
use super::message::headers;

/// `cancel` fired before the message was sent: its offset must stay unstored.
#[derive(Debug)]
pub(crate) struct Cancelled;

/// Where a failed message goes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Destination {
    /// The retry topic, to be tried again at `due_ms`; `attempts` failed so far.
    Retry { attempts: u32, due_ms: i64 },
    /// The dead-letter topic.
    DeadLetter { attempts: u32 },
}

/// Stops consuming `msg`'s partition and rewinds it to `msg`, so that it is read again once
/// resumed.
pub(crate) fn hold(consumer: &StreamConsumer, msg: &BorrowedMessage<'_>) {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(msg.topic(), msg.partition());
    if let Err(e) = consumer.pause(&tpl) {
        tracing::debug!(error = %e, "cannot pause a partition");
    }
    // Asynchronously (a zero timeout): the call must not block the runtime.
    if let Err(e) = consumer.seek(
        msg.topic(),
        msg.partition(),
        Offset::Offset(msg.offset()),
        Duration::ZERO,
    ) {
        tracing::warn!(error = %e, topic = msg.topic(), partition = msg.partition(),
            "cannot rewind a partition; its messages come again after a rebalance");
    }
}

fn set_paused(consumer: &StreamConsumer, paused: bool) {
    let Ok(assignment) = consumer.assignment() else {
        return;
    };
    let result = if paused {
        consumer.pause(&assignment)
    } else {
        consumer.resume(&assignment)
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, paused, "cannot pause or resume the assignment");
    }
}

/// Awaits `future` while polling the consumer (its partitions paused): a message still comes
/// from a partition assigned meanwhile, which is then held too. `None` if `cancel` fires first.
async fn polling<F: std::future::Future>(
    consumer: &StreamConsumer,
    future: F,
    cancel: &CancellationToken,
) -> Option<F::Output> {
    tokio::pin!(future);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return None,
            out = &mut future => return Some(out),
            polled = consumer.recv() => {
                if let Ok(other) = polled {
                    hold(consumer, &other);
                }
            }
        }
    }
}

impl Inner {
    /// Sends `msg` (read from topic `source` for routing: its own, or the one it was retried
    /// from) to `destination`, with its key, value and headers, and the consumer's own headers.
    /// Returns once the broker acknowledged it; until then (a missing topic, say) consumption
    /// waits, polling. `Err` only when `cancel` fires first.
    pub(crate) async fn forward(
        &self,
        consumer: &StreamConsumer,
        msg: &BorrowedMessage<'_>,
        source: &str,
        destination: Destination,
        reason: &str,
        cancel: &CancellationToken,
    ) -> Result<(), Cancelled> {
        let (topic, kind) = match destination {
            Destination::Retry { attempts, .. } => (self.retry_topic(source, attempts), "retry"),
            Destination::DeadLetter { .. } => {
                (format!("{source}{}", self.dlq_suffix), "dead-letter")
            }
        };
        let partition = msg.partition().to_string();
        let offset = msg.offset().to_string();
        let mut failures = 0u32;
        loop {
            let mut out = OwnedHeaders::new();
            if let Some(h) = msg.headers() {
                for header in h.iter().filter(|h| !headers::ALL.contains(&h.key)) {
                    out = out.insert(header);
                }
            }
            let attempts_text;
            let due_text;
            match destination {
                Destination::Retry { attempts, due_ms } => {
                    attempts_text = attempts.to_string();
                    due_text = due_ms.to_string();
                    for (key, value) in [
                        (headers::SOURCE_TOPIC, source),
                        (headers::ATTEMPTS, attempts_text.as_str()),
                        (headers::DUE_MS, due_text.as_str()),
                        (headers::ERROR, reason),
                    ] {
                        out = out.insert(Header {
                            key,
                            value: Some(value.as_bytes()),
                        });
                    }
                }
                Destination::DeadLetter { attempts } => {
                    attempts_text = attempts.to_string();
                    for (key, value) in [
                        ("dlq_error", reason),
                        ("dlq_attempts", attempts_text.as_str()),
                        ("dlq_source_topic", source),
                        ("dlq_source_partition", partition.as_str()),
                        ("dlq_source_offset", offset.as_str()),
                    ] {
                        out = out.insert(Header {
                            key,
                            value: Some(value.as_bytes()),
                        });
                    }
                }
            }
            let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&topic).headers(out);
            if let Some(key) = msg.key() {
                record = record.key(key);
            }
            if let Some(payload) = msg.payload() {
                record = record.payload(payload);
            }
            let send = self.forwarder.send(record, Duration::from_secs(30));
            // Once blocked, poll while waiting, so the consumer stays in its group.
            let sent = if failures == 0 {
                Some(send.await)
            } else {
                polling(consumer, send, cancel).await
            };
            let Some(sent) = sent else {
                set_paused(consumer, false);
                return Err(Cancelled);
            };
            match sent {
                Ok(_) => {
                    if failures > 0 {
                        tracing::info!(topic = %topic, "the {kind} topic takes messages again; consuming");
                        metrics::gauge!("outbox_consumer_forward_blocked", "topic" => topic.clone())
                            .set(0.0);
                        set_paused(consumer, false);
                    }
                    match destination {
                        Destination::Retry { attempts, .. } => {
                            metrics::counter!("outbox_consumer_retried_total").increment(1);
                            tracing::info!(topic = msg.topic(), partition = msg.partition(),
                                offset = msg.offset(), attempts, %reason, "message sent to its retry topic");
                        }
                        Destination::DeadLetter { .. } => {
                            metrics::counter!("outbox_consumer_dead_lettered_total").increment(1);
                            tracing::warn!(topic = msg.topic(), partition = msg.partition(),
                                offset = msg.offset(), %reason, "message dead-lettered");
                        }
                    }
                    return Ok(());
                }
                Err((e, _)) => {
                    failures += 1;
                    if failures == 1 {
                        tracing::error!(error = %e, topic = %topic,
                            "cannot send a message to its {kind} topic (does it exist? may this \
                             consumer write to it?); consumption waits until it can");
                        metrics::gauge!("outbox_consumer_forward_blocked", "topic" => topic.clone())
                            .set(1.0);
                        // Stay in the group: poll, with every partition paused.
                        set_paused(consumer, true);
                    }
                    let wait = tokio::time::sleep(self.backoff(failures));
                    if polling(consumer, wait, cancel).await.is_none() {
                        set_paused(consumer, false);
                        return Err(Cancelled);
                    }
                }
            }
        }
    }
}
