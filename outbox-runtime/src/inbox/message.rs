//! A message read off a broker, checked: what every handler needs, and where it came from (its
//! own topic, or, on Kafka, the retry topic it was sent to after a failure).

use std::time::{SystemTime, UNIX_EPOCH};

use uuid::Uuid;

use super::meta::MessageMeta;
use crate::event::SCHEMA_VERSION_HEADER;

/// Headers the consumer adds to a message it sends to a retry topic or to the dead letters.
pub(crate) mod headers {
    /// The topic the message was first read from (its handlers are routed by it).
    pub(crate) const SOURCE_TOPIC: &str = "outbox_retry_source_topic";
    /// Its partition there (a retried message's handling is serialized with its original's
    /// by it: see `batch::begin`).
    pub(crate) const SOURCE_PARTITION: &str = "outbox_retry_source_partition";
    /// Its offset there.
    pub(crate) const SOURCE_OFFSET: &str = "outbox_retry_source_offset";
    /// Failed attempts so far.
    pub(crate) const ATTEMPTS: &str = "outbox_retry_attempts";
    /// When it may be tried again, in milliseconds since the Unix epoch.
    pub(crate) const DUE_MS: &str = "outbox_retry_due_ms";
    /// The last failure (a retry topic's message).
    #[allow(dead_code)] // written by the brokers with retry topics
    pub(crate) const ERROR: &str = "outbox_retry_error";

    /// A dead letter's: why it failed.
    pub(crate) const DLQ_ERROR: &str = "dlq_error";
    /// A dead letter's: how many attempts failed.
    pub(crate) const DLQ_ATTEMPTS: &str = "dlq_attempts";
    /// A dead letter's: the topic it was read from (its own, or the one it was retried from).
    pub(crate) const DLQ_SOURCE_TOPIC: &str = "dlq_source_topic";
    /// A dead letter's: its partition there (0 on a broker without partitions).
    pub(crate) const DLQ_SOURCE_PARTITION: &str = "dlq_source_partition";
    /// A dead letter's: its offset there (JetStream: its stream sequence).
    pub(crate) const DLQ_SOURCE_OFFSET: &str = "dlq_source_offset";
}

/// A checked message: its metadata (routed by `meta.topic`, its own topic or the one it was
/// retried from, and `meta.event_type`) and its payload.
#[derive(Debug)]
pub(crate) struct Incoming<'m> {
    pub meta: MessageMeta<'m>,
    pub payload: &'m [u8],
    /// The partition of `meta.topic` it was first read from (for a retried message, not
    /// `meta.partition`, the retry topic's); `None` when not read off Kafka.
    pub source_partition: Option<i32>,
}

/// The headers the consumer reads, found in one pass over the message's headers (each header
/// read is a call into librdkafka, on the consumer's critical path).
#[derive(Default)]
struct Read<'m> {
    event_id: Option<&'m [u8]>,
    event_type: Option<&'m [u8]>,
    source_topic: Option<&'m [u8]>,
    source_partition: Option<&'m [u8]>,
    source_offset: Option<&'m [u8]>,
    attempts: Option<&'m [u8]>,
    due_ms: Option<&'m [u8]>,
    schema_version: Option<&'m [u8]>,
    /// CloudEvents attributes (binary content mode), read when the framework's are missing.
    ce_id: Option<&'m [u8]>,
    ce_type: Option<&'m [u8]>,
    ce_source: Option<&'m [u8]>,
    ce_specversion: Option<&'m [u8]>,
    /// The application's headers and CloudEvents attributes (none of the framework's other
    /// headers), with `application`.
    application: Vec<(&'m str, &'m [u8])>,
}

fn text(value: Option<&[u8]>) -> Option<&str> {
    value.and_then(|v| std::str::from_utf8(v).ok())
}

/// The headers the consumer reads among `all` (name, value), and with `application` the
/// application's too.
fn read_headers<'m>(
    all: impl Iterator<Item = (&'m str, Option<&'m [u8]>)>,
    application: bool,
) -> Read<'m> {
    let mut read = Read::default();
    // Of a header given twice, the first counts.
    for (name, value) in all {
        // The application's headers, and a CloudEvent's attributes (`ce_*`: its source, its id
        // as sent, ...), are the handler's to read.
        if application && (name.starts_with("ce_") || !crate::event::is_reserved_header(name)) {
            read.application.push((name, value.unwrap_or_default()));
        }
        let slot = match name {
            "event_id" => &mut read.event_id,
            "event_type" => &mut read.event_type,
            headers::SOURCE_TOPIC => &mut read.source_topic,
            headers::SOURCE_PARTITION => &mut read.source_partition,
            headers::SOURCE_OFFSET => &mut read.source_offset,
            headers::ATTEMPTS => &mut read.attempts,
            headers::DUE_MS => &mut read.due_ms,
            SCHEMA_VERSION_HEADER => &mut read.schema_version,
            "ce_id" => &mut read.ce_id,
            "ce_type" => &mut read.ce_type,
            "ce_source" => &mut read.ce_source,
            "ce_specversion" => &mut read.ce_specversion,
            _ => continue,
        };
        if slot.is_none() {
            *slot = value;
        }
    }
    read
}

/// When a message from a retry topic may be tried again (`None`: now, or not a retry), among
/// its headers (name, value).
#[allow(dead_code)] // read by the brokers with retry topics
pub(crate) fn due_ms<'m>(
    headers: impl Iterator<Item = (&'m str, Option<&'m [u8]>)>,
) -> Option<i64> {
    text(read_headers(headers, false).due_ms)?.parse().ok()
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Where a message was first read (its handlers are routed by its topic), and how often it
/// failed before.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Origin<'m> {
    /// Its own topic, or the one it was retried from.
    pub topic: &'m str,
    /// Its partition there.
    pub partition: i32,
    /// Its offset there (a dead letter's `dlq_source_offset` on Kafka).
    #[allow(dead_code)] // read by the brokers that have retry topics
    pub offset: i64,
    /// Attempts that failed before this one (0 for a message from its own topic).
    pub attempts: u32,
}

/// Where a message with these headers (name, value) was first read.
#[allow(dead_code)] // read by the brokers with retry topics
pub(crate) fn origin<'m>(
    msg: &Delivered<'m>,
    headers: impl Iterator<Item = (&'m str, Option<&'m [u8]>)>,
) -> Origin<'m> {
    origin_of(msg, &read_headers(headers, false))
}

/// A message as delivered, whatever the broker: where it was read, its key and payload.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Delivered<'m> {
    pub topic: &'m str,
    /// Kafka's partition; a JetStream stream is one ordered log: 0.
    pub partition: i32,
    /// Kafka's offset, or the JetStream stream sequence.
    pub offset: i64,
    pub key: Option<&'m [u8]>,
    pub payload: &'m [u8],
}

fn origin_of<'m>(msg: &Delivered<'m>, read: &Read<'m>) -> Origin<'m> {
    fn parsed<T: std::str::FromStr>(value: Option<&[u8]>) -> Option<T> {
        text(value).and_then(|v| v.parse().ok())
    }
    let attempts = parsed(read.attempts).unwrap_or(0);
    match text(read.source_topic) {
        // A copy sent by a version without the partition and offset headers: where it was
        // read stands in.
        Some(topic) => Origin {
            topic,
            partition: parsed(read.source_partition).unwrap_or(msg.partition),
            offset: parsed(read.source_offset).unwrap_or(msg.offset),
            attempts,
        },
        None => Origin {
            topic: msg.topic,
            partition: msg.partition,
            offset: msg.offset,
            attempts,
        },
    }
}

/// Checks what every message needs, its headers given as (name, value); the error is the
/// dead-letter reason. The payload must be JSON; whether PostgreSQL's `jsonb` takes it (inbox
/// mode) is its own business, found out when the message is stored. The metadata's attempt
/// counts the retry topics' failures (a broker that counts deliveries sets its own).
pub(crate) fn check<'m>(
    msg: Delivered<'m>,
    headers: impl Iterator<Item = (&'m str, Option<&'m [u8]>)>,
) -> Result<Incoming<'m>, String> {
    let read = read_headers(headers, true);
    let payload = msg.payload;
    serde_json::from_slice::<serde::de::IgnoredAny>(payload)
        .map_err(|e| format!("payload is not JSON: {e}"))?;
    let (event_id, event_type) = identity(&read)?;
    let schema_version = match read.schema_version {
        None => 1,
        Some(v) => text(Some(v))
            .and_then(|v| v.parse::<u32>().ok())
            .filter(|&v| v > 0)
            .ok_or_else(|| {
                format!(
                    "{SCHEMA_VERSION_HEADER} header is not a positive integer: {:?}",
                    String::from_utf8_lossy(v)
                )
            })?,
    };
    let origin = origin_of(&msg, &read);
    Ok(Incoming {
        meta: MessageMeta {
            event_id,
            event_type,
            topic: origin.topic,
            partition: Some(msg.partition),
            offset: Some(msg.offset),
            key: msg.key,
            headers: read.application,
            attempt: origin.attempts.saturating_add(1),
            schema_version,
        },
        payload,
        source_partition: Some(origin.partition),
    })
}

/// Where CloudEvents ids that are not UUIDs are mapped into UUIDs (version 5, of the source and
/// the id: unique per source, as CloudEvents ids are).
const CLOUD_EVENTS_NAMESPACE: Uuid = Uuid::from_u128(0x6f75_7462_6f78_2d63_6c6f_7564_6576_7473);

/// The event's id and type: the framework's `event_id` and `event_type` headers, or, for a
/// CloudEvent in binary content mode without them, its `ce_id` and `ce_type` (a `ce_id` that
/// is a UUID in canonical form is the id itself; another is mapped to a UUIDv5 of `ce_source`
/// and `ce_id`).
fn identity<'m>(read: &Read<'m>) -> Result<(Uuid, std::borrow::Cow<'m, str>), String> {
    let lossy = |v: Option<&'m [u8]>| v.map(String::from_utf8_lossy).unwrap_or_default();
    if let Some(id) = read.event_id {
        let id = text(Some(id))
            .and_then(|s| Uuid::parse_str(s).ok())
            .ok_or("event_id header is not a UUID")?;
        let event_type = match read.event_type {
            Some(t) => lossy(Some(t)),
            None => lossy(read.ce_type),
        };
        return Ok((id, event_type));
    }
    let Some(ce_id) = read.ce_id else {
        return Err("message has no event_id header (nor a CloudEvents ce_id)".into());
    };
    let spec = text(read.ce_specversion).unwrap_or_default();
    if !spec.starts_with("1.") {
        return Err(format!(
            "a CloudEvent (ce_id) of specversion {spec:?}: version 1.x is read, and ce_specversion is required"
        ));
    }
    let (Some(ce_id), Some(source)) = (text(Some(ce_id)), text(read.ce_source)) else {
        return Err("a CloudEvent needs ce_id and ce_source headers (UTF-8)".into());
    };
    if ce_id.is_empty() || source.is_empty() {
        return Err("a CloudEvent's ce_id and ce_source must not be empty".into());
    }
    let event_type = match read.event_type.or(read.ce_type) {
        Some(t) if !t.is_empty() => lossy(Some(t)),
        _ => return Err("a CloudEvent needs a non-empty ce_type header".into()),
    };
    Ok((cloud_event_id(source, ce_id), event_type))
}

/// A CloudEvent's id as a UUID: `ce_id` itself if it is a UUID spelled canonically (lowercase,
/// hyphenated: two spellings of one UUID are two ids to CloudEvents, which compares them as
/// strings), else a UUIDv5 of `source` and `ce_id`.
fn cloud_event_id(source: &str, ce_id: &str) -> Uuid {
    if let Ok(id) = Uuid::try_parse(ce_id) {
        if id.hyphenated().encode_lower(&mut Uuid::encode_buffer()) == ce_id {
            return id;
        }
    }
    let mut name = Vec::with_capacity(source.len() + 1 + ce_id.len());
    name.extend_from_slice(source.as_bytes());
    name.push(0);
    name.extend_from_slice(ce_id.as_bytes());
    Uuid::new_v5(&CLOUD_EVENTS_NAMESPACE, &name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_canonical_uuid_ce_id_is_the_id_and_other_spellings_are_other_ids() {
        let id = Uuid::new_v4();
        assert_eq!(cloud_event_id("/billing", &id.to_string()), id);
        let spellings = [
            id.to_string().to_uppercase(),
            id.simple().to_string(),
            id.braced().to_string(),
            id.urn().to_string(),
        ];
        for other in &spellings {
            let mapped = cloud_event_id("/billing", other);
            assert_ne!(mapped, id, "{other}");
            assert_eq!(mapped, cloud_event_id("/billing", other), "stable");
            assert_ne!(mapped, cloud_event_id("/shipping", other), "per source");
        }
        assert_ne!(
            cloud_event_id("/billing", "order-42"),
            cloud_event_id("/billin", "gorder-42"),
            "source and id are kept apart"
        );
    }
}
