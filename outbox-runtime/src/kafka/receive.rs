//! Inbox mode's receipt on Kafka: each batch stored in `inbox_event` (one statement,
//! duplicates ignored), what cannot be stored dead-lettered, then the offsets stored. The
//! processors (`inbox/processor.rs`) handle the rows.

use rdkafka::consumer::StreamConsumer;
use tokio_util::sync::CancellationToken;

use super::forward::{Forward, Forwarder};
use super::message;
use super::poll::{next_batch, store_offset, Paused};
use crate::error::Result;
use crate::inbox::failure::Destination;
use crate::inbox::receipt;
use crate::inbox::shared::Shared;

/// Inbox mode's receipt: stores each batch in `inbox_event`, dead-letters what cannot be
/// stored (not JSON, no event id, refused by `jsonb`), then stores the offsets.
pub(crate) async fn consume(
    shared: &Shared,
    forwarder: &Forwarder,
    consumer: &StreamConsumer,
    cancel: &CancellationToken,
) -> Result<()> {
    let settings = &shared.settings;
    let mut paused = Paused::default();
    while let Some(batch) = next_batch(consumer, settings.batch_size, &mut paused, cancel).await {
        let checked: Vec<_> = batch.iter().map(message::check).collect();
        let Some(bad) = receipt::receive_checked(shared, &checked, cancel).await else {
            return Ok(());
        };
        let dead: Vec<Forward<'_, '_>> = batch
            .iter()
            .zip(bad)
            .filter_map(|(msg, reason)| {
                let reason = reason?;
                Some(Forward {
                    msg,
                    origin: message::origin(msg),
                    destination: Destination::DeadLetter { attempts: 1 },
                    reason,
                })
            })
            .collect();
        if forwarder
            .forward_all(consumer, &dead, cancel)
            .await
            .is_err()
        {
            return Ok(()); // cancelled: the batch's offsets stay unstored
        }
        for msg in &batch {
            store_offset(consumer, msg);
        }
    }
    Ok(())
}
