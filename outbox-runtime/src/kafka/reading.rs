//! The consumer's reading on Kafka, both modes: batches off the consumer (a message from a
//! retry topic that is not due yet pauses its partition, rewound to it, until it is), each
//! handed to the core ([`dedup::handle_batch`], [`receive::receive_batch`]); and how a batch
//! is settled on Kafka: failed messages forwarded to their retry or dead-letter topic, then the
//! offsets stored, in order.

use rdkafka::consumer::StreamConsumer;
use rdkafka::message::BorrowedMessage;
use tokio_util::sync::CancellationToken;

use super::forward::{Forward, Forwarder};
use super::message;
use super::poll::{next_batch, store_offset, Paused};
use crate::error::Result;
use crate::inbox::batch::Checked;
use crate::inbox::failure::Destination;
use crate::inbox::settings::Mode;
use crate::inbox::shared::Shared;
use crate::inbox::source::Reading;
use crate::inbox::{dedup, receive};

/// A consumer's Kafka while it reads: the consumer and the retry and dead-letter producer.
struct KafkaReading<'c> {
    consumer: &'c StreamConsumer,
    forwarder: &'c Forwarder,
}

/// Reads batches until `cancel` fires, each handled in the consumer's mode.
pub(crate) async fn consume(
    shared: &Shared,
    forwarder: &Forwarder,
    consumer: &StreamConsumer,
    cancel: &CancellationToken,
) -> Result<()> {
    let settings = &shared.settings;
    let reading = KafkaReading {
        consumer,
        forwarder,
    };
    let mut paused = Paused::default();
    while let Some(batch) = next_batch(consumer, settings.batch_size, &mut paused, cancel).await {
        let now = crate::inbox::message::now_ms();
        let mut ready: Vec<BorrowedMessage<'_>> = Vec::with_capacity(batch.len());
        let mut repaused = Vec::new();
        for msg in batch {
            if paused.is_paused(consumer, &msg, &mut repaused) {
                continue; // read again once its partition resumes
            }
            match message::due_ms(&msg) {
                Some(due) if due > now => paused.pause(consumer, &msg, due),
                _ => ready.push(msg),
            }
        }
        let handled = match settings.mode {
            Mode::Dedup => dedup::handle_batch(shared, &reading, &ready, cancel).await,
            Mode::Inbox => receive::receive_batch(shared, &reading, &ready, cancel).await,
        };
        if !handled {
            return Ok(()); // cancelled: the batch's offsets stay unstored
        }
    }
    Ok(())
}

impl<'c> Reading for KafkaReading<'c> {
    type Message = BorrowedMessage<'c>;

    fn check<'m>(&self, msg: &'m BorrowedMessage<'c>) -> Checked<'m> {
        message::check(msg)
    }

    fn failed_before(&self, msg: &BorrowedMessage<'c>) -> u32 {
        message::origin(msg).attempts
    }

    /// Forwards the failed messages (each acknowledged by the broker; while a topic does not
    /// take one, consumption waits, polling), then stores every offset, in order.
    async fn settle(
        &self,
        done: &[BorrowedMessage<'c>],
        failed: Vec<Option<(Destination, String)>>,
        cancel: &CancellationToken,
    ) -> bool {
        let forwards: Vec<Forward<'_, '_>> = done
            .iter()
            .zip(failed)
            .filter_map(|(msg, failed)| {
                let (destination, reason) = failed?;
                Some(Forward {
                    msg,
                    origin: message::origin(msg),
                    destination,
                    reason,
                })
            })
            .collect();
        if self
            .forwarder
            .forward_all(self.consumer, &forwards, cancel)
            .await
            .is_err()
        {
            return false; // cancelled: their offsets stay unstored
        }
        for msg in done {
            store_offset(self.consumer, msg);
        }
        true
    }
}
