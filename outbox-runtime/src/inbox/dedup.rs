//! Dedup mode, whatever the broker: a batch handled in transactions ([`handle_batch`]), the
//! database's outages waited out ([`handle`]), where a failed message goes ([`verdict`]),
//! retries in place.

use tokio_util::sync::CancellationToken;

use super::batch::{self, Checked, Handled};
use super::database::Db;
use super::failure::{Destination, Failure};
use super::message;
use super::settings::{RetryPolicy, Settings};
use super::shared::Shared;
use super::source::Reading;

/// Dedup mode's work on one batch `messages` of broker `b`: handled in one transaction (see
/// [`batch::handle`]), then settled through `b` (each failed message first sent where its
/// verdict says); with [`RetryPolicy::InPlace`], a message that failed retryably and what
/// follows it tried again after a backoff, before anything else is settled, or dead-lettered
/// once out of attempts. `false` once `cancel` fires or the batch's lease is lost (what is not
/// settled comes again).
pub(crate) async fn handle_batch<B: Reading>(
    shared: &Shared,
    b: &B,
    messages: &[B::Message],
    cancel: &CancellationToken,
) -> bool {
    let settings = &shared.settings;
    let mut checked: Vec<Checked<'_>> = messages.iter().map(|m| b.check(m)).collect();
    let mut start = 0;
    // The message retried in place, and its attempts so far.
    let mut retrying: Option<(usize, u32)> = None;
    while start < checked.len() {
        let fence = b.fence();
        let handling = handle(shared, &checked[start..], cancel, fence.as_ref());
        let Some(outcome) = b.working_on(&messages[start..], handling).await else {
            return false;
        };
        let done = &messages[start..start + outcome.done];
        let mut failed = vec![None; done.len()];
        for (i, failure) in outcome.failed {
            let before = b.failed_before(&done[i]);
            let attempts = attempts(retrying, start + i, before + 1);
            let bad = checked[start + i].is_err();
            failed[i] = Some(verdict(settings, attempts, &failure, bad));
        }
        if !b.settle(done, failed, cancel).await {
            return false;
        }
        start += outcome.done;
        let Some(failure) = outcome.stopped else {
            break;
        };
        // In place: the message at `start` failed retryably; try it (and what follows it)
        // again after a backoff, or dead-letter it once out of attempts.
        let before = b.failed_before(&messages[start]);
        let tries = attempts(retrying, start, before + 1);
        if tries >= settings.max_attempts {
            let dead = (
                Destination::DeadLetter { attempts: tries },
                dead_reason(&failure, tries),
            );
            if !b
                .settle(&messages[start..=start], vec![Some(dead)], cancel)
                .await
            {
                return false;
            }
            start += 1;
            retrying = None;
            continue;
        }
        retrying = retry_in_place(&mut checked, start, tries, &failure);
        let waited = b.working_on(&messages[start..], async {
            tokio::select! {
                () = cancel.cancelled() => false,
                () = tokio::time::sleep(settings.backoff(tries)) => true,
            }
        });
        if !waited.await {
            return false;
        }
    }
    debug_assert!(settings.retry_policy == RetryPolicy::InPlace || retrying.is_none());
    true
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
) -> Option<Handled> {
    let in_place = shared.settings.retry_policy == RetryPolicy::InPlace;
    let mut failures = 0;
    loop {
        let handled = match &shared.db {
            Db::Postgres(pool) => {
                batch::handle(pool, &shared.routes, messages, in_place, fence).await
            }
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                super::batch_mysql::handle(pool, &shared.routes, messages, in_place, fence).await
            }
        };
        match handled {
            Ok(outcome) => {
                metrics::counter!("outbox_consumer_processed_total").increment(outcome.processed);
                metrics::counter!("outbox_consumer_duplicates_total").increment(outcome.duplicates);
                return Some(outcome);
            }
            Err(batch::Unhandled::LeaseLost) => {
                let fence = fence.map(|f| (f.group, f.topic));
                tracing::warn!(
                    ?fence,
                    "a batch was not handled: another instance owns the lease"
                );
                return None;
            }
            Err(batch::Unhandled::Database(e)) => {
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
