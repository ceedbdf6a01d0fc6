//! Dedup mode's loop on Kafka: batches handled in one transaction each ([`batch`]), failed
//! messages forwarded to their retry or dead-letter topic, offsets stored in order; a message
//! from a retry topic that is not due yet pauses its partition until it is. And what every
//! broker's dedup loop shares: handling a batch while the database is out, where a failed
//! message goes.

#[cfg(feature = "kafka")]
use rdkafka::consumer::StreamConsumer;
#[cfg(feature = "kafka")]
use rdkafka::message::BorrowedMessage;
use tokio_util::sync::CancellationToken;

use super::batch::{self, Checked, Outcome};
use super::failure::{Destination, Failure};
#[cfg(feature = "kafka")]
use super::forward::Forward;
use super::message;
#[cfg(feature = "kafka")]
use super::poll::{next_batch, store_offset, Paused};
use super::settings::{RetryPolicy, Settings};
use super::shared::Shared;
#[cfg(feature = "kafka")]
use crate::error::Result;

/// Dedup mode. Messages are handled in batches, one transaction and one commit (one WAL
/// flush) each (see [`batch::handle`]). A failed message is forwarded (to its retry or
/// dead-letter topic) before its offset is stored, offsets in order. A message from a
/// retry topic that is not due yet pauses its partition (rewound to it) until it is.
#[cfg(feature = "kafka")]
pub(crate) async fn consume(
    shared: &Shared,
    consumer: &StreamConsumer,
    cancel: &CancellationToken,
) -> Result<()> {
    let settings = &shared.settings;
    let mut paused = Paused::default();
    while let Some(batch) = next_batch(consumer, settings.batch_size, &mut paused, cancel).await {
        let now = message::now_ms();
        let mut ready: Vec<&BorrowedMessage<'_>> = Vec::with_capacity(batch.len());
        let mut repaused = Vec::new();
        for msg in &batch {
            if paused.is_paused(consumer, msg, &mut repaused) {
                continue; // read again once its partition resumes
            }
            match message::due_ms(msg) {
                Some(due) if due > now => paused.pause(consumer, msg, due),
                _ => ready.push(msg),
            }
        }
        let mut checked: Vec<Checked<'_>> = ready.iter().map(|m| message::check(m)).collect();
        let mut start = 0;
        // The message retried in place, and its attempts so far.
        let mut retrying: Option<(usize, u32)> = None;
        while start < checked.len() {
            let Some(outcome) = handle(shared, &checked[start..], cancel, None).await else {
                return Ok(());
            };
            let settled = &ready[start..start + outcome.done];
            let forwards: Vec<Forward<'_, '_>> = outcome
                .failed
                .into_iter()
                .map(|(i, failure)| {
                    let msg = settled[i];
                    let origin = message::origin(msg);
                    let attempts = attempts(retrying, start + i, origin.attempts + 1);
                    let bad = checked[start + i].is_err();
                    let (destination, reason) = verdict(settings, attempts, &failure, bad);
                    Forward {
                        msg,
                        origin,
                        destination,
                        reason,
                    }
                })
                .collect();
            if shared
                .forwarder()
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
            let tries = attempts(retrying, start, 1);
            if tries >= settings.max_attempts {
                let msg = ready[start];
                let dead = Forward {
                    msg,
                    origin: message::origin(msg),
                    destination: Destination::DeadLetter { attempts: tries },
                    reason: dead_reason(&failure, tries),
                };
                if shared
                    .forwarder()
                    .forward(consumer, &dead, cancel)
                    .await
                    .is_err()
                {
                    return Ok(());
                }
                store_offset(consumer, msg);
                start += 1;
                retrying = None;
                continue;
            }
            retrying = retry_in_place(&mut checked, start, tries, &failure);
            tokio::select! {
                () = cancel.cancelled() => return Ok(()),
                () = tokio::time::sleep(settings.backoff(tries)) => {}
            }
        }
    }
    Ok(())
}

/// Handles checked messages in dedup mode, waiting out database failures (the messages
/// are not at fault: nothing is stored until it commits, and the dedup rows make doing it
/// again harmless). `None` once `cancel` fires, or if the `fence`'s lease is lost (nothing of
/// the batch committed).
pub(crate) async fn handle(
    shared: &Shared,
    messages: &[Checked<'_>],
    cancel: &CancellationToken,
    fence: Option<&batch::Fence<'_>>,
) -> Option<Outcome> {
    let in_place = shared.settings.retry_policy == RetryPolicy::InPlace;
    let mut failures = 0;
    loop {
        match batch::handle(&shared.pool, &shared.routes, messages, in_place, fence).await {
            Ok(outcome) => {
                metrics::counter!("outbox_consumer_processed_total").increment(outcome.processed);
                metrics::counter!("outbox_consumer_duplicates_total").increment(outcome.duplicates);
                return Some(outcome);
            }
            Err(e @ crate::Error::LeaseLost { .. }) => {
                tracing::warn!(error = %e, "a batch was not handled: another instance has the lease");
                return None;
            }
            Err(e) => {
                failures += 1;
                let table = crate::admin::CleanupTable::ProcessedEvent;
                if !shared.wait_out(&e, table, failures, cancel).await {
                    return None;
                }
            }
        }
    }
}

/// The attempts at the message at `index` of a batch so far, its failure included: one more
/// than before if it is the one `retrying` in place (index, attempts), else `otherwise`.
pub(crate) fn attempts(retrying: Option<(usize, u32)>, index: usize, otherwise: u32) -> u32 {
    match retrying {
        Some((r, tries)) if r == index => tries + 1,
        _ => otherwise,
    }
}

/// In place: the message at `start` failed retryably for the `tries`-th time and is tried
/// again (with what follows it) after a backoff; counts and logs it, and makes the next
/// attempt's metadata say so. What `retrying` becomes.
pub(crate) fn retry_in_place(
    checked: &mut [Checked<'_>],
    start: usize,
    tries: u32,
    failure: &Failure,
) -> Option<(usize, u32)> {
    metrics::counter!("outbox_consumer_retried_total").increment(1);
    tracing::info!(
        attempt = tries,
        error = failure.message(),
        "handler failed; retrying in place"
    );
    if let Ok(incoming) = &mut checked[start] {
        incoming.meta.attempt = tries + 1;
    }
    Some((start, tries))
}

/// Where a message that failed its `attempts`-th attempt goes, and the reason it carries
/// there; `bad`: it was bad input, never tried.
pub(crate) fn verdict(
    settings: &Settings,
    attempts: u32,
    failure: &Failure,
    bad: bool,
) -> (Destination, String) {
    let destination = destination(settings, attempts, failure);
    let reason = match destination {
        _ if bad => failure.message().to_owned(),
        Destination::DeadLetter { .. } => dead_reason(failure, attempts),
        Destination::Retry { .. } => failure.message().to_owned(),
    };
    (destination, reason)
}

/// Where a message that failed its `attempts`-th attempt goes.
fn destination(settings: &Settings, attempts: u32, failure: &Failure) -> Destination {
    if failure.is_permanent()
        || attempts >= settings.max_attempts
        || settings.retry_policy == RetryPolicy::InPlace
    {
        Destination::DeadLetter { attempts }
    } else {
        Destination::Retry {
            attempts,
            due_ms: message::now_ms() + settings.backoff(attempts).as_millis() as i64,
        }
    }
}

/// The reason a dead letter carries.
pub(crate) fn dead_reason(failure: &Failure, attempts: u32) -> String {
    format!(
        "{} (after {attempts} attempt{})",
        failure.message(),
        if attempts == 1 { "" } else { "s" }
    )
}
