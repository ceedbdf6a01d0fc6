//! Turning claimed rows into Kafka records and waiting for the broker's acknowledgements.

use std::collections::HashSet;
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::store::Claimed;

/// What became of one record.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The broker acknowledged it.
    Published,
    /// Refused for good (too large, invalid topic, ...): counts as an attempt.
    Rejected(String),
    /// Not sent or not acknowledged for a passing reason (broker down, timeout, queue full):
    /// stays as it is, for the next batch.
    Deferred(String),
    /// Not sent because an earlier record of its key failed in this batch: stays as it is.
    Skipped,
}

/// Errors for which another try of the same record would fail the same way.
pub(crate) fn is_permanent(error: &KafkaError) -> bool {
    use RDKafkaErrorCode::*;
    matches!(
        error.rdkafka_error_code(),
        Some(
            InvalidMessage
                | InvalidMessageSize
                | MessageSizeTooLarge
                | MessageBatchTooLarge
                | InvalidTopic
                | TopicAuthorizationFailed
                | UnsupportedForMessageFormat
                | PolicyViolation
                | InvalidRecord
                | BadMessage
                | UnknownTopic
                | UnknownTopicOrPartition
                | InvalidArgument
        )
    )
}

fn outcome_of_error(error: &KafkaError) -> Outcome {
    if is_permanent(error) {
        Outcome::Rejected(error.to_string())
    } else {
        Outcome::Deferred(error.to_string())
    }
}

/// Sends the rows in order and waits (at most `timeout`) for every acknowledgement. Returns one
/// outcome per row, in the same order.
///
/// Records are all enqueued before any is awaited, so the producer batches them; the idempotent
/// producer keeps their order per partition. Once a record of a key fails to enqueue, the later
/// records of that key in this batch are not sent at all, so a key never overtakes itself.
pub(crate) async fn publish(
    producer: &FutureProducer,
    rows: &[Claimed],
    timeout: Duration,
) -> Vec<Outcome> {
    let mut outcomes: Vec<Option<Outcome>> = Vec::with_capacity(rows.len());
    let mut pending = Vec::with_capacity(rows.len());
    let mut failed_keys: HashSet<&str> = HashSet::new();
    for (i, row) in rows.iter().enumerate() {
        if failed_keys.contains(row.partition_key.as_str()) {
            outcomes.push(Some(Outcome::Skipped));
            continue;
        }
        let event_id = row.event_id.hyphenated().to_string();
        let outbox_id = row.id.to_string();
        let headers = OwnedHeaders::new_with_capacity(6)
            .insert(Header {
                key: "event_id",
                value: Some(event_id.as_bytes()),
            })
            .insert(Header {
                key: "event_type",
                value: Some(row.event_type.as_bytes()),
            })
            .insert(Header {
                key: "aggregate_type",
                value: Some(row.aggregate_type.as_bytes()),
            })
            .insert(Header {
                key: "aggregate_id",
                value: Some(row.aggregate_id.as_bytes()),
            })
            .insert(Header {
                key: "content-type",
                value: Some("application/json".as_bytes()),
            })
            .insert(Header {
                key: "outbox_id",
                value: Some(outbox_id.as_bytes()),
            });
        let record = FutureRecord::to(&row.topic)
            .key(row.partition_key.as_bytes())
            .payload(row.payload.as_bytes())
            .headers(headers)
            .timestamp(row.created_at_ms);
        match producer.send_result(record) {
            Ok(delivery) => {
                outcomes.push(None);
                pending.push((i, delivery));
            }
            Err((error, _)) => {
                failed_keys.insert(&row.partition_key);
                outcomes.push(Some(outcome_of_error(&error)));
            }
        }
    }
    let deadline = tokio::time::Instant::now() + timeout;
    for (i, delivery) in pending {
        let outcome = match tokio::time::timeout_at(deadline, delivery).await {
            Ok(Ok(Ok(_))) => Outcome::Published,
            Ok(Ok(Err((error, _)))) => outcome_of_error(&error),
            Ok(Err(_canceled)) => Outcome::Deferred("the producer was dropped".into()),
            Err(_) => Outcome::Deferred(format!(
                "no acknowledgement within the publish timeout ({timeout:?})"
            )),
        };
        outcomes[i] = Some(outcome);
    }
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Outcome::Deferred("not sent".into())))
        .collect()
}
