//! Inbox mode's receipt, whatever the broker: a batch stored in `inbox_event` (duplicates
//! ignored), then settled through the broker, what cannot be stored dead-lettered first. The
//! processors (`processor.rs`) handle the rows.

use tokio_util::sync::CancellationToken;

use super::batch::Checked;
use super::failure::Destination;
use super::shared::Shared;
use super::source::Batch;
use super::store;

/// Stores batch `messages` of broker `b` in `inbox_event` (waiting out the database's
/// failures), then settles it through `b`: each message that cannot be stored (not JSON, no
/// event id, refused by `jsonb`) dead-lettered first. `false` once `cancel` fires (nothing
/// of it settled: it comes again, and its stored rows are duplicates then).
pub(crate) async fn receive_batch<B: Batch>(
    shared: &Shared,
    b: &B,
    messages: &[B::Message],
    cancel: &CancellationToken,
) -> bool {
    let checked: Vec<Checked<'_>> = messages.iter().map(|m| b.check(m)).collect();
    let storing = store::receive_checked(shared, &checked, cancel);
    let Some(bad) = b.holding(messages, storing).await else {
        return false;
    };
    let failed = bad
        .into_iter()
        .map(|reason| Some((Destination::DeadLetter { attempts: 1 }, reason?)))
        .collect();
    b.settle(messages, failed, cancel).await
}
