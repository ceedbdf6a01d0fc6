//! A message read off Kafka, checked: what every handler needs, and where it came from (its
//! own topic, or the retry topic it was sent to after a failure).

use std::time::{SystemTime, UNIX_EPOCH};

use rdkafka::message::{BorrowedMessage, Headers, Message};
use uuid::Uuid;

use super::handler::MessageMeta;
use crate::event::SCHEMA_VERSION_HEADER;

/// Headers the consumer adds to a message it sends to a retry topic.
pub(crate) mod headers {
    /// The topic the message was first read from (its handlers are routed by it).
    pub(crate) const SOURCE_TOPIC: &str = "outbox_retry_source_topic";
    /// Failed attempts so far.
    pub(crate) const ATTEMPTS: &str = "outbox_retry_attempts";
    /// When it may be tried again, in milliseconds since the Unix epoch.
    pub(crate) const DUE_MS: &str = "outbox_retry_due_ms";
    /// The last failure.
    pub(crate) const ERROR: &str = "outbox_retry_error";
    /// Every header the consumer sets on a retried message (replaced, not repeated, on the
    /// next retry).
    pub(crate) const ALL: [&str; 4] = [SOURCE_TOPIC, ATTEMPTS, DUE_MS, ERROR];
}

/// A checked message: its metadata (routed by `meta.topic`, its own topic or the one it was
/// retried from, and `meta.event_type`) and its payload.
#[derive(Debug)]
pub(crate) struct Incoming<'m> {
    pub meta: MessageMeta<'m>,
    pub payload: &'m [u8],
}

/// The headers the consumer reads, found in one pass over the message's headers (each header
/// read is a call into librdkafka, on the consumer's critical path).
#[derive(Default)]
struct Read<'m> {
    event_id: Option<&'m [u8]>,
    event_type: Option<&'m [u8]>,
    source_topic: Option<&'m [u8]>,
    attempts: Option<&'m [u8]>,
    due_ms: Option<&'m [u8]>,
    schema_version: Option<&'m [u8]>,
    /// The application's headers (none of the framework's), with `application`.
    application: Vec<(&'m str, &'m [u8])>,
}

fn text(value: Option<&[u8]>) -> Option<&str> {
    value.and_then(|v| std::str::from_utf8(v).ok())
}

/// The headers the consumer reads, and with `application` the application's too, in one pass
/// (no allocation for a message without application headers).
fn read<'m>(msg: &'m BorrowedMessage<'_>, application: bool) -> Read<'m> {
    let mut read = Read::default();
    let Some(all) = msg.headers() else {
        return read;
    };
    // Of a header given twice, the first counts.
    for header in all.iter() {
        let slot = match header.key {
            "event_id" => &mut read.event_id,
            "event_type" => &mut read.event_type,
            headers::SOURCE_TOPIC => &mut read.source_topic,
            headers::ATTEMPTS => &mut read.attempts,
            headers::DUE_MS => &mut read.due_ms,
            SCHEMA_VERSION_HEADER => &mut read.schema_version,
            name => {
                if application && !crate::event::is_reserved_header(name) {
                    read.application
                        .push((name, header.value.unwrap_or_default()));
                }
                continue;
            }
        };
        if slot.is_none() {
            *slot = header.value;
        }
    }
    read
}

/// When a message from a retry topic may be tried again (`None`: now, or not a retry).
pub(crate) fn due_ms(msg: &BorrowedMessage<'_>) -> Option<i64> {
    text(read(msg, false).due_ms)?.parse().ok()
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Where a message's handlers are routed from, and how often it failed before.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Origin<'m> {
    /// Its own topic, or the one it was retried from.
    pub topic: &'m str,
    /// Attempts that failed before this one (0 for a message from its own topic).
    pub attempts: u32,
}

pub(crate) fn origin<'m>(msg: &'m BorrowedMessage<'_>) -> Origin<'m> {
    origin_of(msg, &read(msg, false))
}

fn origin_of<'m>(msg: &'m BorrowedMessage<'_>, read: &Read<'m>) -> Origin<'m> {
    Origin {
        topic: text(read.source_topic).unwrap_or(msg.topic()),
        attempts: text(read.attempts)
            .and_then(|a| a.parse().ok())
            .unwrap_or(0),
    }
}

/// Checks what every message needs; the error is the dead-letter reason. The payload must be
/// JSON; whether PostgreSQL's `jsonb` takes it (inbox mode) is its own business, found out when
/// the message is stored. The metadata's attempt counts the retry topics' failures.
pub(crate) fn check<'m>(msg: &'m BorrowedMessage<'_>) -> Result<Incoming<'m>, String> {
    let read = read(msg, true);
    let payload = msg.payload().unwrap_or_default();
    serde_json::from_slice::<serde::de::IgnoredAny>(payload)
        .map_err(|e| format!("payload is not JSON: {e}"))?;
    let event_id = read.event_id.ok_or("message has no event_id header")?;
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
    let event_id = std::str::from_utf8(event_id)
        .ok()
        .and_then(|s| Uuid::parse_str(s).ok())
        .ok_or("event_id header is not a UUID")?;
    let event_type = read
        .event_type
        .map(String::from_utf8_lossy)
        .unwrap_or_default();
    let origin = origin_of(msg, &read);
    Ok(Incoming {
        meta: MessageMeta {
            event_id,
            event_type,
            topic: origin.topic,
            partition: Some(msg.partition()),
            offset: Some(msg.offset()),
            key: msg.key(),
            headers: read.application,
            attempt: origin.attempts.saturating_add(1),
            schema_version,
        },
        payload,
    })
}

/// The application's headers as a JSON object for an inbox row (`None`: it has none). Of a
/// header given twice, the first counts.
pub(crate) fn headers_json(meta: &MessageMeta<'_>) -> Option<String> {
    if meta.headers.is_empty() {
        return None;
    }
    let mut object = serde_json::Map::new();
    for (name, value) in &meta.headers {
        object
            .entry(*name)
            .or_insert_with(|| String::from_utf8_lossy(value).into_owned().into());
    }
    Some(serde_json::Value::Object(object).to_string())
}

/// The headers of an inbox row (its JSON object), by name.
pub(crate) fn headers_from_json(json: Option<&str>) -> Vec<(String, String)> {
    let Some(json) = json else {
        return Vec::new();
    };
    let object: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(json).unwrap_or_default();
    object
        .into_iter()
        .map(|(name, value)| {
            let value = match value {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            (name, value)
        })
        .collect()
}
