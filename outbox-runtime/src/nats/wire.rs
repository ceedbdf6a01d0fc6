//! The NATS wire format of this crate's messages, both ways: a claimed row as the message the
//! relay publishes (subject, headers, `Nats-Msg-Id`), a delivered message's headers as the
//! consumer reads them, a dead letter's headers. Every header name the NATS side writes or
//! reads is here.

use std::borrow::Cow;
use std::str::FromStr;

use async_nats::header::{HeaderMap, HeaderName, HeaderValue};
use async_nats::jetstream::message::PublishMessage;

use crate::inbox::message::headers as consumer_headers;
use crate::publish::cloudevents::{Attributes, CloudEvents};
use crate::store::record::Claimed;

/// The partition key (what a Kafka record's key carries).
pub(crate) const OUTBOX_KEY: &str = "outbox_key";
/// When the event was emitted (or replayed), in milliseconds since the Unix epoch (what a
/// Kafka record's timestamp carries).
pub(crate) const OUTBOX_TIMESTAMP_MS: &str = "outbox_timestamp_ms";
/// The prefix of a CloudEvents attribute's header in the NATS binding (`ce_` on Kafka).
pub(crate) const CE_PREFIX: &str = "ce-";
/// The prefix of the server's own headers (`Nats-Msg-Id`, ...).
const SERVER_PREFIX: &str = "Nats-";
/// The prefix of every dead-letter header (a dead letter's own are replaced, not repeated).
const DLQ_PREFIX: &str = "dlq_";
/// Where a dead letter was read: its stream (JetStream's own dead-letter field).
const DLQ_SOURCE_STREAM: &str = "dlq_source_stream";

/// Whether `subject` can be published on: dot-separated non-empty tokens, no wildcard, no
/// white space or control character.
pub(crate) fn check_subject(subject: &str) -> Result<(), String> {
    let bad_token = subject
        .split('.')
        .any(|t| t.is_empty() || t == "*" || t == ">");
    let bad_char = subject.chars().any(|c| c.is_whitespace() || c.is_control());
    if bad_token || bad_char {
        Err(format!(
            "the topic `{}` is not a NATS subject one can publish on (dot-separated tokens, none \
             empty or a wildcard, no white space)",
            subject.escape_debug()
        ))
    } else {
        Ok(())
    }
}

/// The row as a JetStream message: headers (see [`JetStream`]), `Nats-Msg-Id`, the payload.
/// `Err`: a header the NATS protocol cannot carry (a name with a colon or a space, a value
/// with a line break), the data's fault.
pub(crate) fn message(
    row: &Claimed,
    cloud_events: Option<&CloudEvents>,
) -> Result<PublishMessage, String> {
    let event_id = row.event_id.hyphenated().to_string();
    let mut headers = HeaderMap::new();
    let mut insert = |name: &str, value: &str| -> Result<(), String> {
        let header = HeaderName::from_str(name).map_err(|_| {
            format!(
                "the header name `{}` cannot be sent on NATS",
                name.escape_debug()
            )
        })?;
        let value = HeaderValue::from_str(value).map_err(|_| {
            format!("the value of the header `{name}` cannot be sent on NATS (it has a line break)")
        })?;
        headers.insert(header, value);
        Ok(())
    };
    insert("event_id", &event_id)?;
    insert("event_type", &row.event_type)?;
    insert("aggregate_type", &row.aggregate_type)?;
    insert("aggregate_id", &row.aggregate_id)?;
    insert("content-type", "application/json")?;
    insert("outbox_id", &row.id.to_string())?;
    insert(OUTBOX_KEY, &row.partition_key)?;
    insert(
        OUTBOX_TIMESTAMP_MS,
        &row.replayed_at_ms.unwrap_or(row.created_at_ms).to_string(),
    )?;
    if let Some(ce) = cloud_events.filter(|ce| ce.covers(&row.topic)) {
        let attributes = Attributes {
            id: &event_id,
            event_type: &row.event_type,
            subject: &row.aggregate_id,
            created_at_ms: row.created_at_ms,
        };
        for (name, value) in ce.attributes(&attributes) {
            insert(&format!("{CE_PREFIX}{name}"), &percent_encoded(&value))?;
        }
    }
    if let Some(json) = &row.headers {
        if let Ok(serde_json::Value::Object(object)) = serde_json::from_str(json) {
            for (name, value) in &object {
                match value {
                    serde_json::Value::String(s) => insert(name, s)?,
                    other => insert(name, &other.to_string())?,
                }
            }
        }
    }
    Ok(PublishMessage::build()
        .headers(headers)
        .message_id(message_id(row))
        .payload(bytes::Bytes::copy_from_slice(row.payload.as_bytes())))
}

/// The row's `Nats-Msg-Id`: its event id, or for a replay an id of the replay's own (with the
/// event id, the duplicate window would drop it, and say it was stored).
pub(crate) fn message_id(row: &Claimed) -> String {
    let event_id = row.event_id.hyphenated();
    match row.replayed_at_ms {
        None => event_id.to_string(),
        Some(at) => format!("{event_id}:replay:{at}"),
    }
}

/// A CloudEvents attribute's value as the NATS binding sends it: space, `"`, `%` and what is
/// not printable ASCII percent-encoded (UTF-8 bytes).
fn percent_encoded(value: &str) -> Cow<'_, str> {
    let plain = |b: u8| (0x21..=0x7e).contains(&b) && b != b'"' && b != b'%';
    if value.bytes().all(plain) {
        return Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 8);
    for b in value.bytes() {
        if plain(b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    Cow::Owned(out)
}

/// A delivered message's headers as the consumer reads them (a Kafka record's names):
/// CloudEvents attributes (`ce-*`, percent-encoded) as `ce_*`, decoded; the key from
/// [`OUTBOX_KEY`]; the server's own (`Nats-*`) left out.
pub(crate) struct Decoded {
    pub(crate) key: Option<Vec<u8>>,
    /// In name order (a NATS header map has no order), each name's values in theirs.
    pub(crate) headers: Vec<(String, Vec<u8>)>,
}

/// Reads a delivered message's headers (see [`Decoded`]).
pub(crate) fn decode(map: Option<&HeaderMap>) -> Decoded {
    let mut headers = Vec::new();
    let mut key = None;
    if let Some(map) = map {
        let mut names: Vec<_> = map.iter().collect();
        names.sort_by(|a, b| AsRef::<str>::as_ref(a.0).cmp(b.0.as_ref()));
        for (name, values) in names {
            let name: &str = name.as_ref();
            if name.starts_with(SERVER_PREFIX) {
                continue;
            }
            if name == OUTBOX_KEY {
                key = values.first().map(|v| v.as_str().as_bytes().to_vec());
            }
            for value in values {
                let value = value.as_str();
                headers.push(match name.strip_prefix(CE_PREFIX) {
                    Some(attribute) => (format!("ce_{attribute}"), percent_decoded(value)),
                    None => (name.to_owned(), value.as_bytes().to_vec()),
                });
            }
        }
    }
    Decoded { key, headers }
}

/// Where a dead letter comes from: its topic, and its place in its stream.
pub(crate) struct Source<'a> {
    pub(crate) topic: &'a str,
    pub(crate) stream: &'a str,
    pub(crate) sequence: u64,
    /// When the stream stored it, in nanoseconds since the Unix epoch.
    pub(crate) stored_ns: i128,
}

/// A message's dead letter: its payload and headers (none of the server's, no earlier
/// dead letter's), with the Kafka dead letters' fields (`dlq_error`, `dlq_attempts`,
/// `dlq_source_topic`, `dlq_source_partition` 0, `dlq_source_offset` its stream sequence)
/// and `dlq_source_stream`. Its `Nats-Msg-Id` (`dlq:<stream>:<sequence>:<stored ns>`) makes one
/// published again after a crash stored once (the time it was stored tells a stream deleted
/// and created again, its sequence from 1 again).
pub(crate) fn dead_letter(
    original: Option<&HeaderMap>,
    payload: bytes::Bytes,
    from: &Source<'_>,
    reason: &str,
    attempts: u32,
) -> PublishMessage {
    let mut headers = HeaderMap::new();
    if let Some(original) = original {
        for (name, values) in original.iter() {
            let text: &str = name.as_ref();
            if text.starts_with(SERVER_PREFIX) || text.starts_with(DLQ_PREFIX) {
                continue;
            }
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
    }
    let mut set = |name: &'static str, value: String| {
        // A header value cannot hold a line break (a panic's message may).
        let value: String = value
            .chars()
            .map(|c| if c == '\r' || c == '\n' { ' ' } else { c })
            .collect();
        if let Ok(value) = value.parse::<HeaderValue>() {
            headers.insert(HeaderName::from_static(name), value);
        }
    };
    set(consumer_headers::DLQ_ERROR, reason.to_owned());
    set(consumer_headers::DLQ_ATTEMPTS, attempts.to_string());
    set(consumer_headers::DLQ_SOURCE_TOPIC, from.topic.to_owned());
    set(consumer_headers::DLQ_SOURCE_PARTITION, "0".to_owned());
    set(
        consumer_headers::DLQ_SOURCE_OFFSET,
        from.sequence.to_string(),
    );
    set(DLQ_SOURCE_STREAM, from.stream.to_owned());
    let id = format!("dlq:{}:{}:{}", from.stream, from.sequence, from.stored_ns);
    PublishMessage::build()
        .headers(headers)
        .message_id(&id)
        .payload(payload)
}

/// A percent-encoded header value (the CloudEvents NATS binding's) decoded; what does not
/// decode is kept as it came.
fn percent_decoded(value: &str) -> Vec<u8> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_one_cannot_publish_on_are_refused() {
        for ok in ["order.events", "orders", "a-b_c.D1"] {
            assert!(check_subject(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a..b", ".a", "a.", "a.*", "a.>", "a b", "a\tb"] {
            assert!(check_subject(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn cloud_events_values_are_percent_encoded() {
        assert_eq!(percent_encoded("/orders-service"), "/orders-service");
        assert_eq!(percent_encoded("a b\"%é"), "a%20b%22%25%C3%A9");
    }

    #[test]
    fn percent_encoded_values_are_decoded_and_the_rest_kept() {
        assert_eq!(percent_decoded("a%20b%22%25%C3%A9"), "a b\"%é".as_bytes());
        assert_eq!(percent_decoded("/orders-service"), b"/orders-service");
        assert_eq!(percent_decoded("100%"), b"100%");
        assert_eq!(percent_decoded("%zz%4"), b"%zz%4");
    }
}
