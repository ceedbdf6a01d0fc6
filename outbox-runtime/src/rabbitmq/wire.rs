//! The AMQP wire format of this crate's messages, both ways: a claimed row as the message the
//! relay publishes (its properties, headers and routing key), a delivered message's headers as
//! the consumer reads them, a retry's and a dead letter's headers. Every header name the
//! RabbitMQ side writes or reads is here, and the names of the topology (exchanges, shard
//! queues, delay queues).

use amqprs::{BasicProperties, FieldName, FieldTable, FieldValue, DELIVERY_MODE_PERSISTENT};

use crate::inbox::message::headers as consumer_headers;
use crate::publish::cloudevents::{Attributes, CloudEvents};
use crate::store::record::Claimed;

/// The partition key (what a Kafka record's key carries).
pub(crate) const OUTBOX_KEY: &str = "outbox_key";
/// When the event was emitted (or replayed), in milliseconds since the Unix epoch.
pub(crate) const OUTBOX_TIMESTAMP_MS: &str = "outbox_timestamp_ms";
/// The event id of the message the relay published before this one with the same topic and
/// key, if it published one since it started: what a consumer holds a redelivered message
/// back for (see `consumer.rs`).
pub(crate) const OUTBOX_PREVIOUS: &str = "outbox_previous_event_id";
/// The event's id.
const EVENT_ID: &str = "event_id";
/// The event's outbox row id: a key's messages are published in its order.
const OUTBOX_ID: &str = "outbox_id";
/// The prefix of a CloudEvents attribute's header in the AMQP binding (`ce_` on Kafka).
pub(crate) const CE_PREFIX: &str = "cloudEvents:";
/// The server's count of a quorum queue's returned deliveries (a consumer that went away
/// without acknowledging: a crash).
pub(crate) const DELIVERY_COUNT: &str = "x-delivery-count";
/// The prefix of the server's own headers (`x-death`, `x-delivery-count`, ...).
const SERVER_PREFIX: &str = "x-";
/// The prefix of every dead-letter header (a dead letter's own are replaced, not repeated).
const DLQ_PREFIX: &str = "dlq_";
/// The consumer group that dead-lettered a message (groups share a topic's dead letters).
pub(crate) const DLQ_GROUP: &str = "dlq_group";
/// The longest name AMQP carries (an exchange, a queue, a routing key, a header's name).
const SHORT_MAX: usize = 255;

/// The shard of partition key `key` among `shards`: FNV-1a (64 bits) of its UTF-8 bytes,
/// modulo the count. Stable across versions and languages: part of the wire format.
pub(crate) fn shard_of(key: &str, shards: u16) -> u16 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (hash % u64::from(shards.max(1))) as u16
}

/// A group's queue for shard `shard` of `topic`.
pub(crate) fn shard_queue(topic: &str, group: &str, shard: u16) -> String {
    format!("{topic}.{group}.{shard}")
}

/// Whether `topic` can name an exchange the relay publishes to: 1 to 255 bytes, not a
/// server-reserved name (`amq.*`).
pub(crate) fn check_exchange(topic: &str) -> Result<(), String> {
    if topic.is_empty() || topic.len() > SHORT_MAX - 16 {
        return Err(format!(
            "the topic `{}` cannot name a RabbitMQ exchange (1 to {} bytes, with room for its \
             queues' names)",
            topic.escape_debug(),
            SHORT_MAX - 16
        ));
    }
    if topic.starts_with("amq.") {
        return Err(format!(
            "the topic `{topic}` is a name RabbitMQ reserves (`amq.*`)"
        ));
    }
    Ok(())
}

/// Adds header `name` = `value` to `table`. `Err`: a name AMQP cannot carry (over 255 bytes).
fn insert(table: &mut FieldTable, name: &str, value: &str) -> Result<(), String> {
    let field: FieldName = name.try_into().map_err(|_| {
        format!(
            "the header name `{}…` is too long for AMQP (at most {SHORT_MAX} bytes)",
            name.chars().take(40).collect::<String>()
        )
    })?;
    // amqp_serde's `insert` over an existing name counts the table's length twice (the
    // frame then carries a wrong size and the server closes the connection): remove first.
    table.remove(&field);
    table.insert(field, FieldValue::from(value));
    Ok(())
}

/// The row as an AMQP message: its properties (persistent, `message_id` the event id,
/// `content_type`, `timestamp`, the headers, [`OUTBOX_PREVIOUS`] if `previous` is known) and
/// its body. `Err`: what AMQP cannot carry (a header name over 255 bytes), the data's fault.
pub(crate) fn message(
    row: &Claimed,
    previous: Option<uuid::Uuid>,
    cloud_events: Option<&CloudEvents>,
) -> Result<(BasicProperties, Vec<u8>), String> {
    let event_id = row.event_id.hyphenated().to_string();
    let mut headers = FieldTable::new();
    // The application's first, so that the framework's own win a clash.
    if let Some(json) = &row.headers {
        if let Ok(serde_json::Value::Object(object)) = serde_json::from_str(json) {
            for (name, value) in &object {
                match value {
                    serde_json::Value::String(s) => insert(&mut headers, name, s)?,
                    other => insert(&mut headers, name, &other.to_string())?,
                }
            }
        }
    }
    if let Some(ce) = cloud_events.filter(|ce| ce.covers(&row.topic)) {
        let attributes = Attributes {
            id: &event_id,
            event_type: &row.event_type,
            subject: &row.aggregate_id,
            created_at_ms: row.created_at_ms,
        };
        for (name, value) in ce.attributes(&attributes) {
            insert(&mut headers, &format!("{CE_PREFIX}{name}"), &value)?;
        }
    }
    let at_ms = row.replayed_at_ms.unwrap_or(row.created_at_ms);
    insert(&mut headers, EVENT_ID, &event_id)?;
    insert(&mut headers, "event_type", &row.event_type)?;
    insert(&mut headers, "aggregate_type", &row.aggregate_type)?;
    insert(&mut headers, "aggregate_id", &row.aggregate_id)?;
    insert(&mut headers, "content-type", "application/json")?;
    insert(&mut headers, OUTBOX_ID, &row.id.to_string())?;
    insert(&mut headers, OUTBOX_KEY, &row.partition_key)?;
    insert(&mut headers, OUTBOX_TIMESTAMP_MS, &at_ms.to_string())?;
    if let Some(previous) = previous {
        insert(
            &mut headers,
            OUTBOX_PREVIOUS,
            &previous.hyphenated().to_string(),
        )?;
    }
    let mut properties = BasicProperties::default();
    properties
        .with_message_id(&event_id)
        .with_content_type("application/json")
        .with_delivery_mode(DELIVERY_MODE_PERSISTENT)
        .with_timestamp(u64::try_from(at_ms / 1000).unwrap_or(0))
        .with_headers(headers);
    Ok((properties, row.payload.as_bytes().to_vec()))
}

/// A header's value as bytes: a string's, or any other value's text.
fn value_bytes(value: &FieldValue) -> Vec<u8> {
    match value {
        FieldValue::S(s) => AsRef::<String>::as_ref(s).as_bytes().to_vec(),
        FieldValue::x(b) => format!("{b}").into_bytes(),
        other => other.to_string().into_bytes(),
    }
}

/// A delivered message's headers as the consumer reads them (a Kafka record's names):
/// CloudEvents attributes (`cloudEvents:*`) as `ce_*`; the key from [`OUTBOX_KEY`]; the
/// server's own (`x-*`) left out, but for the delivery count.
pub(crate) struct Decoded {
    pub(crate) key: Option<Vec<u8>>,
    /// In name order (an AMQP table has no order).
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    /// Deliveries the server counted as returned before this one (`x-delivery-count`).
    pub(crate) returned: u32,
    /// The event's id, and its key's previous one's ([`OUTBOX_PREVIOUS`]), if they are ids.
    pub(crate) event_id: Option<uuid::Uuid>,
    pub(crate) previous: Option<uuid::Uuid>,
    /// Its place among its key's messages (`outbox_id`).
    pub(crate) outbox_id: Option<i64>,
}

/// Reads a delivered message's headers (see [`Decoded`]).
pub(crate) fn decode(properties: Option<&BasicProperties>) -> Decoded {
    let mut decoded = Decoded {
        key: None,
        headers: Vec::new(),
        returned: 0,
        event_id: None,
        previous: None,
        outbox_id: None,
    };
    let Some(table) = properties.and_then(BasicProperties::headers) else {
        return decoded;
    };
    let mut fields: Vec<(&String, &FieldValue)> = table
        .as_ref()
        .iter()
        .map(|(name, value)| (AsRef::<String>::as_ref(name), value))
        .collect();
    fields.sort_by(|a, b| a.0.cmp(b.0));
    for (name, value) in fields {
        if name == DELIVERY_COUNT {
            decoded.returned = value.to_string().parse().unwrap_or(0);
            continue;
        }
        if name.starts_with(SERVER_PREFIX) {
            continue;
        }
        let bytes = value_bytes(value);
        let id = || uuid::Uuid::try_parse_ascii(&bytes).ok();
        match name.as_str() {
            OUTBOX_KEY => decoded.key = Some(bytes.clone()),
            EVENT_ID => decoded.event_id = id(),
            OUTBOX_PREVIOUS => decoded.previous = id(),
            OUTBOX_ID => {
                decoded.outbox_id = std::str::from_utf8(&bytes)
                    .ok()
                    .and_then(|t| t.parse().ok());
            }
            _ => {}
        }
        let name = match name.strip_prefix(CE_PREFIX) {
            Some(attribute) => format!("ce_{attribute}"),
            None => name.clone(),
        };
        decoded.headers.push((name, bytes));
    }
    decoded
}

/// Where a retried or dead-lettered message was read.
pub(crate) struct Source<'a> {
    pub(crate) topic: &'a str,
    pub(crate) group: &'a str,
    pub(crate) shard: u16,
}

/// `original`'s headers without the server's and without what `drop` says.
fn kept(original: Option<&BasicProperties>, drop: impl Fn(&str) -> bool) -> FieldTable {
    let mut table = FieldTable::new();
    if let Some(headers) = original.and_then(BasicProperties::headers) {
        for (name, value) in headers.as_ref() {
            let text: &String = name.as_ref();
            if text.starts_with(SERVER_PREFIX) || drop(text) {
                continue;
            }
            table.insert(name.clone(), value.clone());
        }
    }
    table
}

/// `original`'s properties with `headers`, persistent, without what republishing it must not
/// carry: its `expiration` (a retry sets its own; a dead letter stays until taken) and its
/// `user_id` (the server refuses a publish whose `user_id` is not the publishing user's).
fn with_headers(original: Option<&BasicProperties>, headers: FieldTable) -> BasicProperties {
    let mut properties = BasicProperties::default();
    properties
        .with_headers(headers)
        .with_delivery_mode(DELIVERY_MODE_PERSISTENT);
    let Some(original) = original else {
        return properties;
    };
    let text = [
        (
            original.content_type(),
            BasicProperties::with_content_type as Setter,
        ),
        (
            original.content_encoding(),
            BasicProperties::with_content_encoding,
        ),
        (
            original.correlation_id(),
            BasicProperties::with_correlation_id,
        ),
        (original.reply_to(), BasicProperties::with_reply_to),
        (original.message_id(), BasicProperties::with_message_id),
        (original.message_type(), BasicProperties::with_message_type),
        (original.app_id(), BasicProperties::with_app_id),
    ];
    for (value, set) in text {
        if let Some(value) = value {
            set(&mut properties, value);
        }
    }
    if let Some(priority) = original.priority() {
        properties.with_priority(priority);
    }
    if let Some(timestamp) = original.timestamp() {
        properties.with_timestamp(timestamp);
    }
    properties
}

/// A text property's setter.
type Setter = for<'a> fn(&'a mut BasicProperties, &str) -> &'a mut BasicProperties;

/// A header value AMQP carries in a table (any text), a line break made a space.
fn one_line(value: &str) -> String {
    value
        .chars()
        .map(|c| if c == '\r' || c == '\n' { ' ' } else { c })
        .collect()
}

/// A message's retry, for its shard's delay queue: its headers with the attempts so far and
/// when it is due, expiring after `delay_ms` (then dead-lettered back to its shard queue).
pub(crate) fn retry(
    original: Option<&BasicProperties>,
    from: &Source<'_>,
    reason: &str,
    attempts: u32,
    due_ms: i64,
    delay_ms: u64,
) -> BasicProperties {
    let mut headers = kept(original, |name| {
        name == consumer_headers::ATTEMPTS
            || name == consumer_headers::DUE_MS
            || name == consumer_headers::ERROR
    });
    let _ = insert(
        &mut headers,
        consumer_headers::ATTEMPTS,
        &attempts.to_string(),
    );
    let _ = insert(&mut headers, consumer_headers::DUE_MS, &due_ms.to_string());
    let _ = insert(&mut headers, consumer_headers::ERROR, &one_line(reason));
    let _ = insert(
        &mut headers,
        consumer_headers::SOURCE_PARTITION,
        &from.shard.to_string(),
    );
    let mut properties = with_headers(original, headers);
    properties.with_expiration(&delay_ms.max(1).to_string());
    properties
}

/// A message's dead letter: its headers (none of the server's, no earlier dead letter's, no
/// retry's), with the Kafka dead letters' fields (`dlq_error`, `dlq_attempts`,
/// `dlq_source_topic`, `dlq_source_partition` its shard, `dlq_source_offset` 0: a queue has
/// no offsets) and `dlq_group`.
pub(crate) fn dead_letter(
    original: Option<&BasicProperties>,
    from: &Source<'_>,
    reason: &str,
    attempts: u32,
) -> BasicProperties {
    let mut headers = kept(original, |name| {
        name.starts_with(DLQ_PREFIX) || name.starts_with("outbox_retry_")
    });
    let _ = insert(&mut headers, consumer_headers::DLQ_ERROR, &one_line(reason));
    let _ = insert(
        &mut headers,
        consumer_headers::DLQ_ATTEMPTS,
        &attempts.to_string(),
    );
    let _ = insert(&mut headers, consumer_headers::DLQ_SOURCE_TOPIC, from.topic);
    let _ = insert(
        &mut headers,
        consumer_headers::DLQ_SOURCE_PARTITION,
        &from.shard.to_string(),
    );
    let _ = insert(&mut headers, consumer_headers::DLQ_SOURCE_OFFSET, "0");
    let _ = insert(&mut headers, DLQ_GROUP, from.group);
    with_headers(original, headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_always_lands_on_the_same_shard() {
        // FNV-1a 64 of "order-1", as any implementation computes it.
        assert_eq!(shard_of("", 4), (0xcbf2_9ce4_8422_2325u64 % 4) as u16);
        assert_eq!(shard_of("order-1", 4), shard_of("order-1", 4));
        assert_eq!(shard_of("order-1", 1), 0);
        let spread: std::collections::HashSet<u16> =
            (0..100).map(|i| shard_of(&format!("k{i}"), 8)).collect();
        assert_eq!(spread.len(), 8, "100 keys reach every one of 8 shards");
    }

    #[test]
    fn exchange_names_amqp_cannot_take_are_refused() {
        assert!(check_exchange("order.events").is_ok());
        assert!(check_exchange("").is_err());
        assert!(check_exchange("amq.topic").is_err());
        assert!(check_exchange(&"x".repeat(300)).is_err());
    }
}
