//! Turning claimed rows into Kafka records, sending them so that no key overtakes itself, and
//! waiting for the broker's acknowledgements.

use super::cloudevents::{Attributes, CloudEvents};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};

use super::store::Claimed;
use crate::error::PublishError;

/// What became of one record.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The broker acknowledged it, and every earlier record of its key in the batch.
    Published,
    /// Refused: counts as an attempt (the record is parked after `max_attempts`). Errors known
    /// to be permanent (too large, invalid, policy), and errors nobody classified, which must
    /// not be retried forever either.
    Rejected(KafkaError),
    /// Refused for an operator's reason (unknown topic, not authorized): the key waits until
    /// it is fixed; not an attempt, never parked (unless the relay is told to).
    Held(KafkaError),
    /// Not sent, or not acknowledged, for a passing reason (broker down, publish timeout, a
    /// producer that failed for good): stays unpublished, for a later batch.
    Deferred(PublishError),
    /// Not sent, or sent and not counted, because an earlier record of its key did not go
    /// through: stays unpublished, behind it.
    Skipped,
}

/// How the relay treats a Kafka error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// Broker down or slow, leadership moving, queue full: try again, nothing counted.
    Transient,
    /// The topic does not exist or the relay may not write to it: hold the key.
    Operator,
    /// The producer is unusable (a fatal idempotence error): recreate it, try again.
    Fatal,
    /// Anything else, known to be permanent or not known at all: an attempt.
    Refused,
}

/// Sorts a produce error into a [`Class`].
pub(crate) fn classify(error: &KafkaError) -> Class {
    use RDKafkaErrorCode::*;
    let Some(code) = error.rdkafka_error_code() else {
        return match error {
            // The delivery future's producer is gone.
            KafkaError::Canceled => Class::Transient,
            _ => Class::Refused,
        };
    };
    match code {
        Fatal
        | GaplessGuarantee
        | Fenced
        | OutOfOrderSequenceNumber
        | InvalidProducerEpoch
        | ProducerFenced
        | UnknownProducerId
        | InvalidProducerIdMapping => Class::Fatal,
        UnknownTopic
        | UnknownTopicOrPartition
        | UnknownPartition
        | UnknownTopicId
        | TopicAuthorizationFailed
        | ClusterAuthorizationFailed
        | TransactionalIdAuthorizationFailed
        | Authentication
        | SaslAuthenticationFailed
        | UnsupportedSASLMechanism
        | IllegalSASLState
        | SSL => Class::Operator,
        BrokerTransportFailure
        | AllBrokersDown
        | MessageTimedOut
        | OperationTimedOut
        | TimedOutQueue
        | QueueFull
        | Resolve
        | PurgeQueue
        | PurgeInflight
        | BrokerDestroy
        | DestroyBroker
        | Retry
        | InProgress
        | Interrupted
        | WaitCache
        | NodeUpdate
        | UnknownBroker
        | ISRInsufficient
        | LeaderNotAvailable
        | NotLeaderForPartition
        | RequestTimedOut
        | BrokerNotAvailable
        | ReplicaNotAvailable
        | NetworkException
        | NotEnoughReplicas
        | NotEnoughReplicasAfterAppend
        | KafkaStorageError
        | ThrottlingQuotaExceeded
        | FencedLeaderEpoch
        | UnknownLeaderEpoch
        | PreferredLeaderNotAvailable
        | EligibleLeadersNotAvailable
        | ReassignmentInProgress
        | CoordinatorLoadInProgress
        | CoordinatorNotAvailable
        | NotCoordinator
        | ConcurrentTransactions
        | RebootstrapRequired => Class::Transient,
        _ => Class::Refused,
    }
}

/// The outcome of a record that failed with `error`.
fn failed(error: KafkaError) -> Outcome {
    match classify(&error) {
        Class::Transient | Class::Fatal => Outcome::Deferred(PublishError::Kafka(error)),
        Class::Operator => Outcome::Held(error),
        Class::Refused => Outcome::Rejected(error),
    }
}

/// Enqueues one row as a record: key, payload, the framework's headers, the row's creation
/// time as the record's timestamp.
fn send(
    producer: &FutureProducer,
    row: &Claimed,
    cloud_events: Option<&CloudEvents>,
) -> Result<DeliveryFuture, KafkaError> {
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
    let headers = match cloud_events.filter(|ce| ce.covers(&row.topic)) {
        None => headers,
        Some(ce) => ce.headers(
            headers,
            &Attributes {
                id: &event_id,
                event_type: &row.event_type,
                subject: &row.aggregate_id,
                created_at_ms: row.created_at_ms,
            },
        ),
    };
    let headers = match &row.headers {
        None => headers,
        Some(json) => application_headers(headers, json),
    };
    let record = FutureRecord::to(&row.topic)
        .key(row.partition_key.as_bytes())
        .payload(row.payload.as_bytes())
        .headers(headers)
        .timestamp(row.replayed_at_ms.unwrap_or(row.created_at_ms));
    producer.send_result(record).map_err(|(error, _)| error)
}

/// The row's own headers after the framework's, in name order: string values as they are,
/// others (written into the column by hand) as JSON text.
fn application_headers(mut headers: OwnedHeaders, json: &str) -> OwnedHeaders {
    if let Ok(serde_json::Value::Object(object)) = serde_json::from_str::<serde_json::Value>(json) {
        for (name, value) in &object {
            let text;
            let value = match value {
                serde_json::Value::String(s) => s.as_str(),
                other => {
                    text = other.to_string();
                    text.as_str()
                }
            };
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
    }
    headers
}

/// How many records of one key may be in flight at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PerKey {
    /// All of a key's records for one topic go out together; the broker keeps them in order
    /// and refuses what follows a refused one (idempotent sequence numbers).
    Pipelined,
    /// One at a time: the next only once the previous one was acknowledged. For brokers that
    /// do not check idempotent sequence numbers.
    OneInFlight,
}

/// Sends the rows and waits (at most `timeout` in all) for their acknowledgements. Returns one
/// outcome per row, in the same order.
///
/// Order per key: a key's records are enqueued in `id` order, and the idempotent producer
/// keeps that order within a partition; with `enable.gapless.guarantee`, a record the broker
/// refuses fails the producer rather than letting it go on past the refused one, and a broker
/// that checks idempotent sequence numbers (Apache Kafka, Redpanda) refuses the requests that
/// were already in flight behind it. With [`PerKey::OneInFlight`] a key's next record is not
/// sent before the previous one is acknowledged, which keeps that promise on brokers that do
/// not check. A record for another topic than the key's records still in flight waits until
/// they are acknowledged (there is no order across partitions), in a later wave. Once a record
/// of a key fails, the later records of the key are not sent; and a later record is only
/// counted as published if every earlier one of its key was.
pub(crate) async fn publish(
    producer: &FutureProducer,
    rows: &[Claimed],
    timeout: Duration,
    per_key: PerKey,
    cloud_events: Option<&CloudEvents>,
) -> Vec<Outcome> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut outcomes: Vec<Option<Outcome>> = (0..rows.len()).map(|_| None).collect();
    let mut failed_keys: HashSet<&str> = HashSet::new();
    let mut waiting: Vec<usize> = (0..rows.len()).collect();
    while !waiting.is_empty() {
        // One wave: every waiting record whose key has nothing in flight on another topic.
        let mut in_flight: HashMap<&str, &str> = HashMap::new();
        let mut held_back: HashSet<&str> = HashSet::new();
        let mut next = Vec::new();
        let mut wave = Vec::new();
        for i in waiting {
            let row = &rows[i];
            let key = row.partition_key.as_str();
            if failed_keys.contains(key) {
                outcomes[i] = Some(Outcome::Skipped);
                continue;
            }
            let must_wait = in_flight
                .get(key)
                .is_some_and(|t| *t != row.topic || per_key == PerKey::OneInFlight);
            if must_wait || held_back.contains(key) {
                held_back.insert(key);
                next.push(i);
                continue;
            }
            match send(producer, row, cloud_events) {
                Ok(delivery) => {
                    in_flight.insert(key, &row.topic);
                    wave.push((i, delivery));
                }
                Err(error) => {
                    failed_keys.insert(key);
                    outcomes[i] = Some(failed(error));
                }
            }
        }
        for (i, delivery) in wave {
            let outcome = match tokio::time::timeout_at(deadline, delivery).await {
                // With acks=all, a record the broker appended has an offset. librdkafka also
                // reports success without one (an idempotent retry it takes for a duplicate of
                // an earlier write): not proof enough to mark the row; it is sent again (at
                // worst a duplicate).
                Ok(Ok(Ok(delivery))) if delivery.offset < 0 => {
                    tracing::warn!(
                        id = rows[i].id,
                        partition = delivery.partition,
                        "a record was acknowledged without an offset; it will be sent again"
                    );
                    metrics::counter!("outbox_relay_unconfirmed_acks_total").increment(1);
                    Outcome::Deferred(PublishError::NoOffset)
                }
                Ok(Ok(Ok(delivery))) => {
                    tracing::trace!(
                        id = rows[i].id,
                        partition = delivery.partition,
                        offset = delivery.offset,
                        "acknowledged"
                    );
                    Outcome::Published
                }
                Ok(Ok(Err((error, _)))) => failed(error),
                Ok(Err(_canceled)) => Outcome::Deferred(PublishError::ProducerDropped),
                Err(_) => Outcome::Deferred(PublishError::Timeout(timeout)),
            };
            if outcome != Outcome::Published {
                failed_keys.insert(rows[i].partition_key.as_str());
            }
            outcomes[i] = Some(outcome);
        }
        waiting = next;
        if tokio::time::Instant::now() >= deadline {
            break;
        }
    }
    let mut outcomes: Vec<Outcome> = outcomes
        .into_iter()
        .map(|o| o.unwrap_or(Outcome::Deferred(PublishError::NotSent)))
        .collect();
    keep_key_order(rows, &mut outcomes);
    outcomes
}

/// A record counts as published only if every earlier record of its key in the batch does:
/// an acknowledgement that comes after an earlier record of the key failed is not trusted (the
/// earlier one will be sent again, and this one after it).
fn keep_key_order(rows: &[Claimed], outcomes: &mut [Outcome]) {
    let mut failed_keys: HashSet<&str> = HashSet::new();
    for (row, outcome) in rows.iter().zip(outcomes.iter_mut()) {
        let key = row.partition_key.as_str();
        if *outcome != Outcome::Published {
            failed_keys.insert(key);
        } else if failed_keys.contains(key) {
            tracing::error!(id = row.id, key, topic = %row.topic,
                "a record was acknowledged after an earlier record of its key failed; \
                 it will be sent again after that one");
            metrics::counter!("outbox_relay_out_of_order_acks_total").increment(1);
            *outcome = Outcome::Skipped;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_sorted_into_classes() {
        let code = |c| KafkaError::MessageProduction(c);
        assert_eq!(
            classify(&code(RDKafkaErrorCode::MessageTimedOut)),
            Class::Transient
        );
        assert_eq!(
            classify(&code(RDKafkaErrorCode::NotLeaderForPartition)),
            Class::Transient
        );
        assert_eq!(
            classify(&code(RDKafkaErrorCode::UnknownTopicOrPartition)),
            Class::Operator
        );
        assert_eq!(
            classify(&code(RDKafkaErrorCode::TopicAuthorizationFailed)),
            Class::Operator
        );
        assert_eq!(classify(&code(RDKafkaErrorCode::Fatal)), Class::Fatal);
        assert_eq!(
            classify(&code(RDKafkaErrorCode::MessageSizeTooLarge)),
            Class::Refused
        );
        assert_eq!(
            classify(&code(RDKafkaErrorCode::PolicyViolation)),
            Class::Refused
        );
        // Nobody classified it: an attempt, so that it cannot be retried forever.
        assert_eq!(
            classify(&code(RDKafkaErrorCode::InvalidConfig)),
            Class::Refused
        );
    }
}
