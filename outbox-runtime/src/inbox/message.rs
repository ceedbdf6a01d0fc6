//! A message read off Kafka, checked: what every handler needs, and where it came from (its
//! own topic, or the retry topic it was sent to after a failure).

use std::time::{SystemTime, UNIX_EPOCH};

use rdkafka::message::{BorrowedMessage, Headers, Message};
use uuid::Uuid;

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

/// A checked message.
#[derive(Debug)]
pub(crate) struct Incoming<'m> {
    pub event_id: Uuid,
    pub event_type: String,
    pub payload: &'m [u8],
    /// The topic its handlers are routed by: its own, or the one it was retried from.
    pub topic: &'m str,
}

pub(crate) fn header<'m>(msg: &'m BorrowedMessage<'_>, name: &str) -> Option<&'m [u8]> {
    msg.headers()?.iter().find(|h| h.key == name)?.value
}

fn header_str<'m>(msg: &'m BorrowedMessage<'_>, name: &str) -> Option<&'m str> {
    header(msg, name).and_then(|v| std::str::from_utf8(v).ok())
}

/// When a message from a retry topic may be tried again (`None`: now, or not a retry).
pub(crate) fn due_ms(msg: &BorrowedMessage<'_>) -> Option<i64> {
    header_str(msg, headers::DUE_MS)?.parse().ok()
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
    Origin {
        topic: header_str(msg, headers::SOURCE_TOPIC).unwrap_or(msg.topic()),
        attempts: header_str(msg, headers::ATTEMPTS)
            .and_then(|a| a.parse().ok())
            .unwrap_or(0),
    }
}

/// Checks what every message needs; the error is the dead-letter reason. The payload must be
/// JSON; whether PostgreSQL's `jsonb` takes it (inbox mode) is its own business, found out when
/// the message is stored.
pub(crate) fn check<'m>(msg: &'m BorrowedMessage<'_>) -> Result<Incoming<'m>, String> {
    let payload = msg.payload().unwrap_or_default();
    serde_json::from_slice::<serde::de::IgnoredAny>(payload)
        .map_err(|e| format!("payload is not JSON: {e}"))?;
    let event_id = header(msg, "event_id").ok_or("message has no event_id header")?;
    let event_id = std::str::from_utf8(event_id)
        .ok()
        .and_then(|s| Uuid::parse_str(s).ok())
        .ok_or("event_id header is not a UUID")?;
    let event_type = header(msg, "event_type")
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .unwrap_or_default();
    Ok(Incoming {
        event_id,
        event_type,
        payload,
        topic: origin(msg).topic,
    })
}
