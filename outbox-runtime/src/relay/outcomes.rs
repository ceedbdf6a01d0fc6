//! What a batch's outcomes come to, whichever the database: the rows to mark published, those
//! to record as refused (an attempt, or a hold), and whether the broker must be waited out.

use std::time::Instant;

use super::settings::Settings;
use crate::error::PublishError;
use crate::publish::Outcome;
use crate::store::record::Claimed;
use crate::store::relay::Refused;

/// How often held keys (an operator's problem) are tried again, at most.
const HELD_RETRY: std::time::Duration = std::time::Duration::from_secs(10);

/// A batch's outcomes, sorted.
pub(super) struct Sorted {
    pub(super) published: Vec<i64>,
    pub(super) failed: Vec<Refused>,
    /// The broker could not be reached (or did not answer in time): the batch backs off.
    pub(super) deferred: Option<PublishError>,
    /// The lowest claimed id neither published nor recorded as failed (its key's later rows
    /// are not held by the database: they must be claimed again).
    pub(super) unsettled: Option<i64>,
}

/// Sorts the outcomes of `rows` (one each, in order).
pub(super) fn sort(rows: &[Claimed], outcomes: Vec<Outcome>, relay: &Settings) -> Sorted {
    let mut sorted = Sorted {
        published: Vec::with_capacity(rows.len()),
        failed: Vec::new(),
        deferred: None,
        unsettled: None,
    };
    for (row, outcome) in rows.iter().zip(outcomes) {
        let attempt = u32::try_from(row.attempts).unwrap_or(0) + 1;
        match outcome {
            Outcome::Published => sorted.published.push(row.id),
            Outcome::Rejected(error) => {
                tracing::warn!(id = row.id, event_id = %row.event_id, topic = %row.topic,
                    attempt, %error, "broker refused an outbox record");
                sorted.failed.push(Refused {
                    id: row.id,
                    error: error.to_string(),
                    backoff_secs: relay.backoff.delay(attempt).as_secs_f64(),
                    held: false,
                });
            }
            Outcome::Held(error) if relay.hold_operator_errors => {
                tracing::error!(id = row.id, topic = %row.topic, %error,
                    "outbox record held: its topic (or stream) is missing or not writable; \
                     its key waits until an operator fixes it");
                sorted.failed.push(Refused {
                    id: row.id,
                    error: error.to_string(),
                    backoff_secs: relay.backoff.max.min(HELD_RETRY).as_secs_f64(),
                    held: true,
                });
            }
            Outcome::Held(error) => {
                sorted.failed.push(Refused {
                    id: row.id,
                    error: error.to_string(),
                    backoff_secs: relay.backoff.delay(attempt).as_secs_f64(),
                    held: false,
                });
            }
            Outcome::Deferred(error) => {
                sorted.deferred.get_or_insert(error);
                sorted.unsettled.get_or_insert(row.id);
            }
            // Behind a failed record of its key. If that one was parked at once, this row is
            // not held by the database: claim it again.
            Outcome::Skipped => {
                sorted.unsettled.get_or_insert(row.id);
            }
        }
    }
    sorted
}

/// The span a batch runs in, `outbox_relay_batch` (its counts recorded as it goes).
pub(super) fn batch_span(shards: usize) -> tracing::Span {
    tracing::info_span!(
        "outbox_relay_batch",
        claimed = tracing::field::Empty,
        published = tracing::field::Empty,
        shards
    )
}

/// Counts a recorded batch in the relay's metrics (and logs what was parked).
pub(super) fn count(published: u64, failed: usize, parked: u64, started: Instant) {
    tracing::Span::current().record("published", published);
    metrics::counter!("outbox_relay_published_total").increment(published);
    metrics::counter!("outbox_relay_failed_total").increment(failed as u64);
    metrics::counter!("outbox_relay_parked_total").increment(parked);
    metrics::histogram!("outbox_relay_publish_seconds").record(started.elapsed().as_secs_f64());
    if parked > 0 {
        tracing::error!(parked, "outbox records parked after repeated refusals");
    }
}
