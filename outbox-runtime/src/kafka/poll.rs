//! The Kafka consumer's mechanics: batches of what is waiting, offsets stored once settled,
//! retry partitions paused (and rewound) until their next message is due.

use std::time::Duration;

use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use crate::inbox::message;

/// The next batch: waits for one message, then takes what is already waiting (up to
/// `batch_size`) without waiting for more. Resumes paused retry partitions when they are due.
/// `None` once cancelled.
pub(crate) async fn next_batch<'c>(
    consumer: &'c StreamConsumer,
    batch_size: usize,
    paused: &mut Paused,
    cancel: &CancellationToken,
) -> Option<Vec<BorrowedMessage<'c>>> {
    loop {
        paused.resume_due(consumer);
        let wake = paused.next_due();
        // In this order: told to stop, it takes no other batch however long the backlog, and
        // a retry partition due resumes however busy the others are.
        let first = tokio::select! {
            biased;
            () = cancel.cancelled() => return None,
            () = tokio::time::sleep(wake.unwrap_or_default()), if wake.is_some() => continue,
            msg = consumer.recv() => msg,
        };
        let mut batch = Vec::with_capacity(batch_size);
        match first {
            Ok(msg) => batch.push(msg),
            Err(e) => {
                tracing::warn!(error = %crate::error_chain(&e), "kafka consumer error");
                continue;
            }
        }
        while batch.len() < batch_size {
            match tokio::time::timeout(Duration::ZERO, consumer.recv()).await {
                Ok(Ok(msg)) => batch.push(msg),
                _ => break,
            }
        }
        return Some(batch);
    }
}

/// Stores a handled message's offset for the next commit. If the partition moved to another
/// member meanwhile (a rebalance), the offset cannot be stored: the new owner gets the message
/// again and deduplicates it, so this only logs.
pub(crate) fn store_offset(consumer: &StreamConsumer, msg: &BorrowedMessage<'_>) {
    if let Err(e) = consumer.store_offset(msg.topic(), msg.partition(), msg.offset()) {
        tracing::info!(error = %crate::error_chain(&e), topic = msg.topic(), partition = msg.partition(),
            offset = msg.offset(), "offset not stored; the message will be seen again");
    }
}

/// Partitions of retry topics paused until their next message is due: topic, partition, when
/// it is due, its offset.
#[derive(Default)]
pub(crate) struct Paused {
    partitions: Vec<(String, i32, i64, i64)>,
}

impl Paused {
    /// Pauses `msg`'s partition and rewinds it to `msg`, until `due_ms`.
    pub(crate) fn pause(
        &mut self,
        consumer: &StreamConsumer,
        msg: &BorrowedMessage<'_>,
        due_ms: i64,
    ) {
        rewind(consumer, msg);
        self.partitions
            .retain(|(t, p, _, _)| (t.as_str(), *p) != (msg.topic(), msg.partition()));
        self.partitions.push((
            msg.topic().to_owned(),
            msg.partition(),
            due_ms,
            msg.offset(),
        ));
    }

    /// Whether `msg`'s partition is paused. A message of a paused partition can still come
    /// (one fetched before the pause, or after a blocked send resumed every partition): the
    /// partition is paused and rewound to its waiting message again, once per `batch` (a fresh
    /// list per batch).
    pub(crate) fn is_paused(
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
            rewind_to(consumer, topic, *partition, *offset);
            batch.push((topic.clone(), *partition));
        }
        true
    }

    /// How long until the first paused partition is due.
    pub(crate) fn next_due(&self) -> Option<Duration> {
        let due = self.partitions.iter().map(|(_, _, due, _)| *due).min()?;
        Some(Duration::from_millis(
            u64::try_from(due - message::now_ms()).unwrap_or(0),
        ))
    }

    /// Resumes the partitions that are due.
    pub(crate) fn resume_due(&mut self, consumer: &StreamConsumer) {
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

/// Stops consuming `msg`'s partition and rewinds it to `msg`, so that it is read again once
/// resumed.
pub(crate) fn rewind(consumer: &StreamConsumer, msg: &BorrowedMessage<'_>) {
    rewind_to(consumer, msg.topic(), msg.partition(), msg.offset());
}

/// Stops consuming a partition and rewinds it to `offset`.
fn rewind_to(consumer: &StreamConsumer, topic: &str, partition: i32, offset: i64) {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    if let Err(e) = consumer.pause(&tpl) {
        tracing::debug!(error = %crate::error_chain(&e), "cannot pause a partition");
    }
    // Asynchronously (a zero timeout): the call must not block the runtime.
    if let Err(e) = consumer.seek(topic, partition, Offset::Offset(offset), Duration::ZERO) {
        tracing::warn!(error = %crate::error_chain(&e), topic, partition,
            "cannot rewind a partition; its messages come again after a rebalance");
    }
}
