//! Inbox mode's receipt, whatever the broker: a batch stored in `inbox_event` (duplicates
//! ignored; the SQL is `store/inbox.rs`'s, database failures waited out here), then settled
//! through the broker, what cannot be stored dead-lettered first. The processors
//! (`processor.rs`) handle the rows.

use tokio_util::sync::CancellationToken;

use super::batch::Checked;
use super::failure::Destination;
use super::shared::Shared;
use super::source::Reading;
use crate::store::inbox::{self as store, InboxRow};

/// Stores batch `messages` of broker `b` in `inbox_event` (waiting out the database's
/// failures), then settles it through `b`: each message that cannot be stored (not JSON, no
/// event id, refused by `jsonb`) dead-lettered first. `false` once `cancel` fires (nothing
/// of it settled: it comes again, and its stored rows are duplicates then).
pub(crate) async fn receive_batch<B: Reading>(
    shared: &Shared,
    b: &B,
    messages: &[B::Message],
    cancel: &CancellationToken,
) -> bool {
    let checked: Vec<Checked<'_>> = messages.iter().map(|m| b.check(m)).collect();
    let storing = receive_checked(shared, &checked, cancel);
    let Some(bad) = b.working_on(messages, storing).await else {
        return false;
    };
    let failed = bad
        .into_iter()
        .map(|reason| Some((Destination::DeadLetter { attempts: 1 }, reason?)))
        .collect();
    b.settle(messages, failed, cancel).await
}

/// Inbox mode's receipt of a batch, whatever the broker: stores the checked messages
/// ([`store::receive`], waiting out database failures), counts them, and returns for each message the reason it is a
/// dead letter (not JSON, no event id, refused by `jsonb`), `None` for one stored (or already
/// there). `None` once `cancel` fires: nothing is settled.
pub(crate) async fn receive_checked(
    shared: &Shared,
    checked: &[Checked<'_>],
    cancel: &CancellationToken,
) -> Option<Vec<Option<String>>> {
    let mut rows = Vec::with_capacity(checked.len());
    let mut stored = Vec::with_capacity(checked.len());
    let mut bad: Vec<Option<String>> = vec![None; checked.len()];
    for (i, message) in checked.iter().enumerate() {
        match message {
            Ok(incoming) => {
                stored.push(i);
                let meta = &incoming.meta;
                rows.push(InboxRow {
                    event_id: meta.event_id,
                    topic: meta.topic,
                    event_type: meta.event_type.clone().into_owned(),
                    partition_key: meta
                        .key_bytes()
                        .map(|k| String::from_utf8_lossy(k).into_owned()),
                    // Where it was read: always known of a message off a broker.
                    partition: meta.partition.unwrap_or_default(),
                    offset: meta.offset.unwrap_or_default(),
                    payload: incoming.payload,
                    headers: store::headers_json(&meta.headers),
                    schema_version: meta.schema_version,
                });
            }
            Err(reason) => bad[i] = Some(reason.clone()),
        }
    }
    let mut failures = 0;
    let received = loop {
        let e = match store::receive(shared.pg(), &rows).await {
            Ok(received) => break received,
            Err(e) => e,
        };
        failures += 1;
        if !shared
            .wait_out(&e, crate::admin::CleanupTable::Inbox, failures, cancel)
            .await
        {
            return None;
        }
    };
    metrics::counter!("outbox_inbox_received_total").increment(received.new);
    if received.new > 0 {
        shared.wake_processors();
    }
    let refused = received.refused.len() as u64;
    metrics::counter!("outbox_consumer_duplicates_total")
        .increment(rows.len() as u64 - received.new - refused);
    for (row, reason) in received.refused {
        bad[stored[row]] = Some(reason);
    }
    Some(bad)
}
