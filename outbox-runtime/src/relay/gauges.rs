//! What a running relay instance reports, on either database: the backlog gauges, and whether
//! it owns shards (for `Relay::ready`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::RelayStatus;
use crate::error::Result;

/// How often a running relay reports the backlog gauges.
pub(super) const GAUGES_EVERY: Duration = Duration::from_secs(10);

/// Sets `outbox_relay_backlog`, `outbox_relay_held`, `outbox_relay_parked` and
/// `outbox_relay_oldest_unpublished_age_seconds` from the backlog figures.
pub(super) fn report_backlog(status: Result<RelayStatus>) {
    match status {
        Ok(s) => {
            metrics::gauge!("outbox_relay_backlog").set(s.unpublished as f64);
            metrics::gauge!("outbox_relay_held").set(s.held as f64);
            metrics::gauge!("outbox_relay_parked").set(s.parked as f64);
            metrics::gauge!("outbox_relay_oldest_unpublished_age_seconds")
                .set(s.oldest_unpublished_age.map_or(0.0, |a| a.as_secs_f64()));
        }
        Err(e) => {
            tracing::debug!(error = %crate::error_chain(&e), "cannot read the outbox backlog")
        }
    }
}

/// Counts a running instance in the relay's count while it owns shards, until it stops.
pub(super) struct Owning<'a> {
    pub(super) count: &'a AtomicUsize,
    pub(super) owns: bool,
}

impl Owning<'_> {
    pub(super) fn set(&mut self, owns: bool) {
        if owns != self.owns {
            self.owns = owns;
            if owns {
                self.count.fetch_add(1, Ordering::Relaxed);
            } else {
                self.count.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for Owning<'_> {
    fn drop(&mut self) {
        self.set(false);
    }
}
