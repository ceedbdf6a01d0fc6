//! Inbox mode's receipt: each batch off Kafka stored in `inbox_event` (one statement,
//! duplicates ignored), what cannot be stored dead-lettered, then the offsets stored. The
//! processors ([`processor`](super::processor)) handle the rows.

use rdkafka::consumer::StreamConsumer;
use rdkafka::message::Message;
use tokio_util::sync::CancellationToken;

use super::failure::Destination;
use super::forward::Forward;
use super::message;
use super::poll::{next_batch, store_offset, Paused};
use super::shared::Shared;
use super::store;
use crate::error::Result;

/// Inbox mode's receipt: stores each batch in `inbox_event`, dead-letters what cannot be
/// stored (not JSON, no event id, refused by `jsonb`), then stores the offsets.
pub(crate) async fn consume(
    shared: &Shared,
    consumer: &StreamConsumer,
    cancel: &CancellationToken,
) -> Result<()> {
    let settings = &shared.settings;
    let mut paused = Paused::default();
    while let Some(batch) = next_batch(consumer, settings.batch_size, &mut paused, cancel).await {
        let mut rows = Vec::with_capacity(batch.len());
        let mut stored = Vec::with_capacity(batch.len());
        let mut bad: Vec<Option<String>> = vec![None; batch.len()];
        for (i, msg) in batch.iter().enumerate() {
            match message::check(msg) {
                Ok(incoming) => {
                    stored.push(i);
                    let meta = &incoming.meta;
                    rows.push(store::InboxRow {
                        event_id: meta.event_id,
                        topic: meta.topic,
                        event_type: meta.event_type.clone().into_owned(),
                        partition_key: msg.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                        partition: msg.partition(),
                        offset: msg.offset(),
                        payload: incoming.payload,
                        headers: message::headers_json(meta),
                        schema_version: meta.schema_version,
                    });
                }
                Err(reason) => bad[i] = Some(reason),
            }
        }
        let mut failures = 0;
        let received = loop {
            let e = match store::receive(&shared.pool, &rows).await {
                Ok(received) => break received,
                Err(e) => e,
            };
            failures += 1;
            if !shared
                .wait_out(&e, crate::admin::CleanupTable::Inbox, failures, cancel)
                .await
            {
                return Ok(());
            }
        };
        metrics::counter!("outbox_inbox_received_total").increment(received.new);
        let refused = received.refused.len() as u64;
        metrics::counter!("outbox_consumer_duplicates_total")
            .increment(rows.len() as u64 - received.new - refused);
        for (row, reason) in received.refused {
            bad[stored[row]] = Some(reason);
        }
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
        if shared
            .forwarder()
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
