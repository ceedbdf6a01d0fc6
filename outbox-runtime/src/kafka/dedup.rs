//! Dedup mode's loop on Kafka: batches handled in one transaction each (the core's
//! [`dedup::handle`]), failed messages forwarded to their retry or dead-letter topic, offsets
//! stored in order; a message from a retry topic that is not due yet pauses its partition until
//! it is.

use rdkafka::consumer::StreamConsumer;
use rdkafka::message::BorrowedMessage;
use tokio_util::sync::CancellationToken;

use super::forward::{Forward, Forwarder};
use super::poll::{next_batch, store_offset, Paused};
use crate::error::Result;
use crate::inbox::batch::Checked;
use crate::inbox::dedup;
use crate::inbox::failure::Destination;
use crate::inbox::shared::Shared;

/// Dedup mode. Messages are handled in batches, one transaction and one commit (one WAL
/// flush) each (see [`batch::handle`](crate::inbox::batch::handle)). A failed message is forwarded (to its retry or
/// dead-letter topic) before its offset is stored, offsets in order. A message from a
/// retry topic that is not due yet pauses its partition (rewound to it) until it is.
pub(crate) async fn consume(
    shared: &Shared,
    forwarder: &Forwarder,
    consumer: &StreamConsumer,
    cancel: &CancellationToken,
) -> Result<()> {
    let settings = &shared.settings;
    let mut paused = Paused::default();
    while let Some(batch) = next_batch(consumer, settings.batch_size, &mut paused, cancel).await {
        let now = crate::inbox::message::now_ms();
        let mut ready: Vec<&BorrowedMessage<'_>> = Vec::with_capacity(batch.len());
        let mut repaused = Vec::new();
        for msg in &batch {
            if paused.is_paused(consumer, msg, &mut repaused) {
                continue; // read again once its partition resumes
            }
            match super::message::due_ms(msg) {
                Some(due) if due > now => paused.pause(consumer, msg, due),
                _ => ready.push(msg),
            }
        }
        let mut checked: Vec<Checked<'_>> =
            ready.iter().map(|m| super::message::check(m)).collect();
        let mut start = 0;
        // The message retried in place, and its attempts so far.
        let mut retrying: Option<(usize, u32)> = None;
        while start < checked.len() {
            let Some(outcome) = dedup::handle(shared, &checked[start..], cancel, None).await else {
                return Ok(());
            };
            let settled = &ready[start..start + outcome.done];
            let forwards: Vec<Forward<'_, '_>> = outcome
                .failed
                .into_iter()
                .map(|(i, failure)| {
                    let msg = settled[i];
                    let origin = super::message::origin(msg);
                    let attempts = dedup::attempts(retrying, start + i, origin.attempts + 1);
                    let bad = checked[start + i].is_err();
                    let (destination, reason) = dedup::verdict(settings, attempts, &failure, bad);
                    Forward {
                        msg,
                        origin,
                        destination,
                        reason,
                    }
                })
                .collect();
            if forwarder
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
            let tries = dedup::attempts(retrying, start, 1);
            if tries >= settings.max_attempts {
                let msg = ready[start];
                let dead = Forward {
                    msg,
                    origin: super::message::origin(msg),
                    destination: Destination::DeadLetter { attempts: tries },
                    reason: dedup::dead_reason(&failure, tries),
                };
                if forwarder.forward(consumer, &dead, cancel).await.is_err() {
                    return Ok(());
                }
                store_offset(consumer, msg);
                start += 1;
                retrying = None;
                continue;
            }
            retrying = dedup::retry_in_place(&mut checked, start, tries, &failure);
            tokio::select! {
                () = cancel.cancelled() => return Ok(()),
                () = tokio::time::sleep(settings.backoff(tries)) => {}
            }
        }
    }
    Ok(())
}
