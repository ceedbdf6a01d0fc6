//! The relay's Kafka transport: claimed rows as Kafka records on the relay's idempotent
//! producer, and how Kafka's errors are sorted.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers as _, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer as _};

use super::producer::ProducerSlot;
use crate::error::{PublishError, Result};
use crate::publish::cloudevents::{Attributes, CloudEvents};
use crate::publish::{order, Boxed, Class, Options, Outcome, PerKey, Sender, Transport};
use crate::store::record::Claimed;

/// The relay's transport to Kafka: the idempotent producer every instance shares.
struct Kafka {
    slot: ProducerSlot,
    /// The producer's `message.max.bytes`, as a refusal of a record too large says it.
    limit: String,
}

/// librdkafka's `message.max.bytes` when it is not set.
const DEFAULT_MESSAGE_MAX_BYTES: &str = "1000000";

/// `message.max.bytes = 10000`, or `message.max.bytes = 1000000 (librdkafka's default)`: the
/// producer's limit, as an error says it.
fn limit_of(client: &ClientConfig) -> String {
    match client.get("message.max.bytes") {
        Some(set) => format!("message.max.bytes = {set}"),
        None => format!("message.max.bytes = {DEFAULT_MESSAGE_MAX_BYTES} (librdkafka's default)"),
    }
}

/// The relay's transport to the Kafka cluster `config` names (its producer created).
pub(crate) fn transport(config: &super::config::Config) -> Result<Box<dyn Transport>> {
    transport_with(config.client.clone())
}

/// A transport on a producer with these settings (a replay's).
pub(crate) fn transport_with(client: ClientConfig) -> Result<Box<dyn Transport>> {
    Ok(Box::new(Kafka {
        limit: limit_of(&client),
        slot: ProducerSlot::new(client)?,
    }))
}

impl Transport for Kafka {
    fn publish<'a>(&'a self, rows: &'a [Claimed], options: Options<'a>) -> Boxed<'a, Vec<Outcome>> {
        Box::pin(async move {
            let producer = self.slot.get();
            let sender = Producing {
                producer: &producer,
                limit: &self.limit,
            };
            let outcomes = order::publish(&sender, rows, options).await;
            self.slot.recover(&producer);
            outcomes
        })
    }

    fn ready(&self, within: Duration) -> Boxed<'_, std::result::Result<(), String>> {
        let producer = self.slot.get();
        Box::pin(async move {
            let asked = tokio::task::spawn_blocking(move || {
                producer.client().fetch_metadata(None, within).map(|_| ())
            })
            .await;
            match asked {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("the broker: {e}")),
                Err(e) => Err(format!("the broker check failed: {e}")),
            }
        })
    }
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

/// The outcome of a record that failed with `error`. A record refused as too large says by
/// whom, its sizes and the limit it met (librdkafka words its error as the broker's whoever
/// refused it).
fn failed(error: KafkaError, refused: Refused, size: &Size, limit: &str) -> Outcome {
    let class = classify(&error);
    if error.rdkafka_error_code() != Some(RDKafkaErrorCode::MessageSizeTooLarge) {
        return class.outcome(PublishError::Kafka(error));
    }
    let detail = match refused {
        Refused::BeforeSending => format!(
            "the producer refused it before sending: its payload is {} bytes (with its key and \
             headers, about {} bytes), over the producer's {limit}",
            thousands(size.payload),
            thousands(size.record()),
        ),
        Refused::OnDelivery => format!(
            "the broker refused it: its payload is {} bytes (with its key and headers, about {} \
             bytes), over the broker's limit (its message.max.bytes or the topic's \
             max.message.bytes: its answer does not say which, nor the figure); the producer \
             allows {limit}",
            thousands(size.payload),
            thousands(size.record()),
        ),
    };
    class.outcome(PublishError::KafkaTooLarge {
        error: Box::new(error),
        detail: detail.into(),
    })
}

/// Who refused a record: the producer, when it was handed over, or the broker (or the
/// producer, sending it) after.
#[derive(Debug, Clone, Copy)]
enum Refused {
    BeforeSending,
    OnDelivery,
}

/// A record's sizes, in bytes: what a refusal as too large says.
#[derive(Debug, Clone, Copy)]
struct Size {
    payload: usize,
    key: usize,
    headers: usize,
}

impl Size {
    fn record(&self) -> usize {
        self.payload + self.key + self.headers
    }
}

/// `1,152,021`.
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The relay's producer, with its limit, as the publishing order drives it.
struct Producing<'a> {
    producer: &'a FutureProducer,
    limit: &'a str,
}

impl<'a> Sender for Producing<'a> {
    type Delivery = Delivery<'a>;

    // The idempotent producer numbers a key's records and the broker refuses what does not
    // follow on from what it stored (`RelayBuilder::one_record_in_flight_per_key` for brokers
    // that do not check).
    const IN_FLIGHT: PerKey = PerKey::Pipelined;

    async fn send(
        &self,
        row: &Claimed,
        cloud_events: Option<&CloudEvents>,
    ) -> Result<Delivery<'a>, Outcome> {
        match send(self.producer, row, cloud_events) {
            Ok((future, size)) => Ok(Delivery {
                id: row.id,
                future,
                size,
                limit: self.limit,
            }),
            Err((error, size)) => Err(failed(error, Refused::BeforeSending, &size, self.limit)),
        }
    }
}

/// A record enqueued on the producer, until librdkafka reports on it.
pub(crate) struct Delivery<'a> {
    id: i64,
    future: DeliveryFuture,
    size: Size,
    limit: &'a str,
}

impl Future for Delivery<'_> {
    type Output = Outcome;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Outcome> {
        let (id, size, limit) = (self.id, self.size, self.limit);
        Pin::new(&mut self.future)
            .poll(cx)
            .map(|delivered| match delivered {
                // With acks=all, a record the broker appended has an offset. librdkafka also
                // reports success without one (an idempotent retry it takes for a duplicate of an
                // earlier write): not proof enough to mark the row; it is sent again (at worst a
                // duplicate).
                Ok(Ok(delivery)) if delivery.offset < 0 => {
                    tracing::warn!(
                        id,
                        partition = delivery.partition,
                        "a record was acknowledged without an offset; it will be sent again"
                    );
                    metrics::counter!("outbox_relay_unconfirmed_acks_total").increment(1);
                    Outcome::Deferred(PublishError::NoOffset)
                }
                Ok(Ok(delivery)) => {
                    tracing::trace!(
                        id,
                        partition = delivery.partition,
                        offset = delivery.offset,
                        "acknowledged"
                    );
                    Outcome::Published
                }
                Ok(Err((error, _))) => failed(error, Refused::OnDelivery, &size, limit),
                Err(_canceled) => Outcome::Deferred(PublishError::ProducerDropped),
            })
    }
}

/// Enqueues one row as a record: key, payload, the framework's headers, the row's creation
/// time as the record's timestamp. With the future, or the error, the record's sizes.
fn send(
    producer: &FutureProducer,
    row: &Claimed,
    cloud_events: Option<&CloudEvents>,
) -> Result<(DeliveryFuture, Size), (KafkaError, Size)> {
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
        Some(ce) => {
            let attributes = Attributes {
                id: &event_id,
                event_type: &row.event_type,
                subject: &row.aggregate_id,
                created_at_ms: row.created_at_ms,
            };
            ce.attributes(&attributes)
                .fold(headers, |headers, (name, value)| {
                    headers.insert(Header {
                        key: &format!("ce_{name}"),
                        value: Some(value.as_bytes()),
                    })
                })
        }
    };
    let headers = match &row.headers {
        None => headers,
        Some(json) => application_headers(headers, json),
    };
    let size = Size {
        payload: row.payload.len(),
        key: row.partition_key.len(),
        headers: headers
            .iter()
            .map(|h| h.key.len() + h.value.map_or(0, <[u8]>::len))
            .sum(),
    };
    let record = FutureRecord::to(&row.topic)
        .key(row.partition_key.as_bytes())
        .payload(row.payload.as_bytes())
        .headers(headers)
        .timestamp(row.replayed_at_ms.unwrap_or(row.created_at_ms));
    match producer.send_result(record) {
        Ok(future) => Ok((future, size)),
        Err((error, _)) => Err((error, size)),
    }
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

    #[test]
    fn a_record_too_large_says_its_size_and_the_limit_only_beside_the_error() {
        let size = Size {
            payload: 1_152_021,
            key: 6,
            headers: 120,
        };
        let limit = limit_of(&ClientConfig::new());
        let too_large = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        let Outcome::Rejected(error) =
            failed(too_large.clone(), Refused::BeforeSending, &size, &limit)
        else {
            panic!("not rejected")
        };
        assert_eq!(
            error.to_string(),
            format!(
                "{too_large}: the producer refused it before sending: its payload is 1,152,021 \
                 bytes (with its key and headers, about 1,152,147 bytes), over the producer's \
                 message.max.bytes = 1000000 (librdkafka's default)"
            )
        );
        // Any other error is the error alone.
        let policy = KafkaError::MessageProduction(RDKafkaErrorCode::PolicyViolation);
        assert_eq!(
            failed(policy.clone(), Refused::OnDelivery, &size, &limit),
            Outcome::Rejected(PublishError::Kafka(policy))
        );
    }
}
