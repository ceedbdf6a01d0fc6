//! The JetStream transport: claimed rows as NATS messages published to JetStream, each
//! acknowledged once its stream stored it, and how JetStream's errors are sorted.
//!
//! The mapping, documented on [`JetStream`]: a row's topic is the subject, as it is; its
//! partition key travels in the `outbox_key` header; `Nats-Msg-Id` is the event id.

use std::collections::{HashMap, HashSet};
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_nats::header::{HeaderMap, HeaderName, HeaderValue};
use async_nats::jetstream::context::{
    GetStreamByNameErrorKind, PublishAckFuture, PublishErrorKind,
};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self, ErrorCode};

use super::cloudevents::{Attributes, CloudEvents};
use super::publish::{Outcome, Sender};
use super::store::Claimed;
use crate::error::PublishError;

/// The relay's JetStream: a connected NATS client, and what the relay does about streams.
/// Give it to [`RelayBuilder::jetstream`](super::RelayBuilder::jetstream).
///
/// # The mapping
///
/// - **Subject**: the event's topic, as it is (`order.events` is published on the subject
///   `order.events`). A topic that is not a valid subject to publish on (empty tokens, spaces,
///   wildcards) is refused like a record Kafka refuses: an attempt, parked after
///   `max_attempts`.
/// - **The partition key** is the `outbox_key` header, not a subject token: keys are any text
///   (an e-mail address, a path) and a subject token cannot hold a dot or a space; and a subject
///   per key would make the server keep state for every key there ever was. Order per key needs
///   no subject of its own: a stream stores what one connection publishes in the order it
///   arrives, and the relay sends a key's next message only once the previous one is stored.
/// - **Headers**: those a Kafka record carries (`event_id`, `event_type`, `aggregate_type`,
///   `aggregate_id`, `content-type`, `outbox_id`, the application's own, and with
///   [`CloudEvents`] the attributes as `ce-*` headers, the NATS binding's prefix), plus
///   `outbox_key` and `outbox_timestamp_ms` (what Kafka's record key and timestamp carry).
/// - **`Nats-Msg-Id`** is the event id: the server drops a message it stored within its
///   stream's duplicate window (2 minutes by default), so what a relay sends again after a crash
///   or a lost acknowledgement is stored once. A row is marked published only once the server
///   acknowledged it (a duplicate's acknowledgement included: the stream has it).
///
/// # Streams
///
/// A stream must capture each topic's subject. By default the relay only checks: it looks the
/// stream up the first time it publishes a topic, and while none captures it, the topic's
/// records are held (as for a Kafka topic that does not exist: `outbox status` and the
/// `outbox_relay_held` gauge show it, nothing is lost, publishing resumes once the stream is
/// created). With [`create_streams(true)`](Self::create_streams) it creates a missing one
/// instead: named after the topic (`order.events` → `order_events`), capturing its subject,
/// file storage, limits retention, [`stream_replicas`](Self::stream_replicas) replicas. A
/// stream whose duplicate window is shorter than the relay's failover timeout is logged: a
/// relay's resend after a failover could then be stored twice.
#[derive(Debug, Clone)]
pub struct JetStream {
    pub(crate) client: async_nats::Client,
    pub(crate) create_streams: bool,
    pub(crate) replicas: usize,
    pub(crate) ack_wait: Duration,
}

impl JetStream {
    /// Publishes through `client` (`async_nats::connect(...)`), checking streams, not
    /// creating them.
    pub fn new(client: async_nats::Client) -> Self {
        JetStream {
            client,
            create_streams: false,
            replicas: 1,
            ack_wait: Duration::from_secs(30),
        }
    }

    /// Whether the relay creates a stream for a topic no stream captures (default `false`:
    /// the topic's records are held until an operator creates one).
    pub fn create_streams(mut self, create: bool) -> Self {
        self.create_streams = create;
        self
    }

    /// Replicas of the streams the relay creates (default 1; at most 5).
    pub fn stream_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// Consumers: how long the server waits for a delivered message's acknowledgement before
    /// it delivers the message again (the durable consumer's `ack_wait`; default 30 s, at least
    /// 1 s). A consumer that holds a message longer (a slow handler, the database out) tells
    /// the server it is still at it, so this bounds how soon a crashed consumer's messages
    /// come again, not how long a handler may take.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        if self.ack_wait < Duration::from_secs(1) {
            return Err(format!(
                "ack_wait must be at least 1 s, not {:?}",
                self.ack_wait
            ));
        }
        if !(1..=5).contains(&self.replicas) {
            return Err(format!(
                "stream_replicas must be between 1 and 5, not {}",
                self.replicas
            ));
        }
        Ok(())
    }

    /// The publisher a relay's instances share. `timeout` bounds the client's own waits (the
    /// relay bounds each batch's).
    pub(crate) fn publisher(self, timeout: Duration, failover: Duration) -> Publisher {
        let context = jetstream::ContextBuilder::new()
            .timeout(timeout)
            .build(self.client.clone());
        Publisher {
            client: self.client,
            context,
            create_streams: self.create_streams,
            replicas: self.replicas,
            failover,
            streams: Arc::new(Mutex::new(HashSet::new())),
            missing: Mutex::new(HashMap::new()),
        }
    }
}

/// A relay's JetStream publisher, shared by its instances.
pub(crate) struct Publisher {
    client: async_nats::Client,
    context: jetstream::Context,
    create_streams: bool,
    replicas: usize,
    failover: Duration,
    /// The topics a stream was found (or created) for: looked up again once a publish finds
    /// none.
    streams: Arc<Mutex<HashSet<String>>>,
    /// Topics no stream captured, and when that was seen: looked up again only after
    /// [`MISSING_KEPT`], so that a held topic's many keys cost one lookup, not one each.
    missing: Mutex<HashMap<String, Instant>>,
}

/// How long a topic found without a stream is taken to have none.
const MISSING_KEPT: Duration = Duration::from_secs(1);

impl Publisher {
    /// Whether JetStream answers (the account's information) within `within`. (Read as JSON:
    /// async-nats's `Account` does not read what a 2.9 server answers.)
    pub(crate) async fn ready(&self, within: Duration) -> Result<(), String> {
        let asked = self.client.request("$JS.API.INFO", bytes::Bytes::new());
        let answer = match tokio::time::timeout(within, asked).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => return Err(format!("JetStream: {}", crate::error_chain(&e))),
            Err(_) => return Err(format!("JetStream did not answer within {within:?}")),
        };
        match serde_json::from_slice::<serde_json::Value>(&answer.payload) {
            Ok(info) => match info.get("error") {
                None => Ok(()),
                Some(error) => Err(format!("JetStream: {error}")),
            },
            Err(e) => Err(format!("JetStream answered what is not JSON: {e}")),
        }
    }

    fn stream_known(&self, topic: &str) -> bool {
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(topic)
    }

    /// Finds the stream that captures `topic`'s subject, or creates it (if told to).
    async fn ensure_stream(&self, topic: &str) -> Result<(), Outcome> {
        let missing = || {
            Outcome::Held(PublishError::JetStream(format!(
                "no stream captures the subject `{topic}`: create one (or let the relay: \
                 JetStream::create_streams)"
            )))
        };
        let seen_missing = self
            .missing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(topic)
            .is_some_and(|at| at.elapsed() < MISSING_KEPT);
        if seen_missing {
            return Err(missing());
        }
        let create = self.create_streams.then_some(StreamSpec {
            replicas: self.replicas,
            duplicate_window: DUPLICATE_WINDOW.max(self.failover * 2),
        });
        let name = match stream_for(&self.context, topic, create).await {
            Ok(name) => name,
            Err(Lookup::Missing) => {
                self.missing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(topic.to_owned(), Instant::now());
                return Err(missing());
            }
            Err(Lookup::Failed(e)) => return Err(Outcome::Deferred(PublishError::JetStream(e))),
        };
        if let Ok(mut stream) = self.context.get_stream(&name).await {
            if let Ok(info) = stream.info().await {
                let window = info.config.duplicate_window;
                if window < self.failover {
                    tracing::warn!(stream = name, topic, ?window, failover = ?self.failover,
                        "the stream's duplicate window is shorter than the relay's failover \
                         timeout: a record a relay sends again after a failover may be stored \
                         twice");
                }
            }
        }
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(topic.to_owned());
        Ok(())
    }
}

/// How to create a stream for a subject no stream captures.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamSpec {
    pub(crate) replicas: usize,
    pub(crate) duplicate_window: Duration,
}

/// Why no stream was found for a subject.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// No stream captures it (and none was to be created).
    Missing,
    /// The server did not answer, or refused: what it said.
    Failed(String),
}

/// The name of the stream that captures `subject`; with `create`, one created for it if none
/// does (named by [`stream_name`], capturing the subject alone, file storage, limits
/// retention).
pub(crate) async fn stream_for(
    context: &jetstream::Context,
    subject: &str,
    create: Option<StreamSpec>,
) -> Result<String, Lookup> {
    let failed = |what: &str, e: &(dyn std::error::Error + 'static)| {
        Lookup::Failed(format!("{what}: {}", crate::error_chain(e)))
    };
    match context.stream_by_subject(subject).await {
        Ok(name) => Ok(name),
        Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => {
            let Some(spec) = create else {
                return Err(Lookup::Missing);
            };
            let config = jetstream::stream::Config {
                name: stream_name(subject),
                subjects: vec![subject.to_owned()],
                num_replicas: spec.replicas,
                duplicate_window: spec.duplicate_window,
                ..Default::default()
            };
            context
                .create_stream(config)
                .await
                .map_err(|e| failed("cannot create the stream", &e))?;
            tracing::info!(
                subject,
                stream = stream_name(subject),
                "created a JetStream stream"
            );
            Ok(stream_name(subject))
        }
        Err(e) => Err(failed("cannot look the stream up", &e)),
    }
}

/// A stream's default duplicate window (the server's).
pub(crate) const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

impl Sender for Publisher {
    type Delivery = Delivery;

    async fn send(
        &self,
        row: &Claimed,
        cloud_events: Option<&CloudEvents>,
    ) -> Result<Delivery, Outcome> {
        if let Err(reason) = check_subject(&row.topic) {
            return Err(Outcome::Rejected(PublishError::JetStream(reason)));
        }
        let message = message(row, cloud_events)
            .map_err(|reason| Outcome::Rejected(PublishError::JetStream(reason)))?;
        if !self.stream_known(&row.topic) {
            self.ensure_stream(&row.topic).await?;
        }
        match self.context.send_publish(row.topic.clone(), message).await {
            Ok(ack) => Ok(Delivery {
                id: row.id,
                topic: Some(row.topic.clone()),
                streams: Arc::clone(&self.streams),
                future: ack.into_future(),
            }),
            Err(error) => Err(failed(&error)),
        }
    }
}

/// A message on its way, until the server acknowledges or refuses it.
pub(crate) struct Delivery {
    id: i64,
    /// To forget the topic's stream if the server says there is none.
    topic: Option<String>,
    streams: Arc<Mutex<HashSet<String>>>,
    future: <PublishAckFuture as IntoFuture>::IntoFuture,
}

impl Future for Delivery {
    type Output = Outcome;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Outcome> {
        let acked: Result<PublishAck, _> = std::task::ready!(self.future.as_mut().poll(cx));
        Poll::Ready(match acked {
            Ok(ack) => {
                tracing::trace!(
                    id = self.id,
                    stream = ack.stream,
                    sequence = ack.sequence,
                    duplicate = ack.duplicate,
                    "acknowledged"
                );
                Outcome::Published
            }
            Err(error) => {
                if error.kind() == PublishErrorKind::StreamNotFound {
                    if let Some(topic) = self.topic.take() {
                        self.streams
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&topic);
                    }
                }
                failed(&error)
            }
        })
    }
}

/// How the relay treats a JetStream error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// The server or the connection is down or slow: try again, nothing counted.
    Transient,
    /// No stream, JetStream off, not allowed: hold the key.
    Operator,
    /// Anything else (a stream limit with `discard new`, a message over the stream's maximum
    /// size, what nobody classified): an attempt.
    Refused,
}

fn classify(error: &jetstream::context::PublishError) -> Class {
    match error.kind() {
        PublishErrorKind::StreamNotFound => Class::Operator,
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::MaxAckPending => Class::Transient,
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
            Class::Refused
        }
        _ => match std::error::Error::source(error)
            .and_then(|source| source.downcast_ref::<jetstream::Error>())
        {
            Some(server) => {
                classify_server(server.code(), server.error_code(), &server.to_string())
            }
            // The client could not send it (its connection task is gone).
            None => Class::Transient,
        },
    }
}

/// Sorts an error the server answered a publish with: `code` is its HTTP-like status (503 for
/// a full stream as for a server without a quorum: the error code tells them apart).
fn classify_server(code: usize, error_code: ErrorCode, text: &str) -> Class {
    match error_code {
        // The stream's store refused it: a limit with `discard new` (maximum messages, bytes,
        // messages per subject) is a refusal; a closed store or a full disk passes.
        ErrorCode::STREAM_STORE_FAILED
            if text.contains("store is closed") || text.contains("insufficient") =>
        {
            Class::Transient
        }
        ErrorCode::STREAM_STORE_FAILED | ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM => {
            Class::Refused
        }
        ErrorCode::JETSTREAM_NOT_ENABLED
        | ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT
        | ErrorCode::ACCOUNT_RESOURCES_EXCEEDED
        | ErrorCode::STREAM_NOT_FOUND => Class::Operator,
        ErrorCode::CLUSTER_NOT_AVAILABLE | ErrorCode::INSUFFICIENT_RESOURCES => Class::Transient,
        _ if code == 503 => Class::Transient,
        _ if code == 401 || code == 403 => Class::Operator,
        _ => Class::Refused,
    }
}

/// The outcome of a message that failed with `error`.
fn failed(error: &jetstream::context::PublishError) -> Outcome {
    let class = classify(error);
    let error = PublishError::JetStream(crate::error_chain(error).to_string());
    match class {
        Class::Transient => Outcome::Deferred(error),
        Class::Operator => Outcome::Held(error),
        Class::Refused => Outcome::Rejected(error),
    }
}

/// Whether `subject` can be published on: dot-separated non-empty tokens, no wildcard, no
/// white space or control character.
fn check_subject(subject: &str) -> Result<(), String> {
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

/// The name of the stream the relay creates for `topic`: what a stream name cannot hold
/// (`.`, `*`, `>`, path separators, white space) becomes `_`.
pub(crate) fn stream_name(topic: &str) -> String {
    topic
        .chars()
        .map(|c| match c {
            '.' | '*' | '>' | '/' | '\\' => '_',
            c if c.is_whitespace() || c.is_control() => '_',
            c => c,
        })
        .collect()
}

/// The row as a JetStream message: headers (see [`JetStream`]), `Nats-Msg-Id`, the payload.
/// `Err`: a header the NATS protocol cannot carry (a name with a colon or a space, a value
/// with a line break), the data's fault.
fn message(row: &Claimed, cloud_events: Option<&CloudEvents>) -> Result<PublishMessage, String> {
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
    insert("outbox_key", &row.partition_key)?;
    insert(
        "outbox_timestamp_ms",
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
            insert(&format!("ce-{name}"), &percent_encoded(&value))?;
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
    // A replay's own id: with the event id, the duplicate window would drop it (and say it
    // was stored).
    let message_id = match row.replayed_at_ms {
        None => event_id,
        Some(at) => format!("{event_id}:replay:{at}"),
    };
    Ok(PublishMessage::build()
        .headers(headers)
        .message_id(&message_id)
        .payload(bytes::Bytes::copy_from_slice(row.payload.as_bytes())))
}

/// A CloudEvents attribute's value as the NATS binding sends it: space, `"`, `%` and what is
/// not printable ASCII percent-encoded (UTF-8 bytes).
fn percent_encoded(value: &str) -> std::borrow::Cow<'_, str> {
    let plain = |b: u8| (0x21..=0x7e).contains(&b) && b != b'"' && b != b'%';
    if value.bytes().all(plain) {
        return std::borrow::Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 8);
    for b in value.bytes() {
        if plain(b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    std::borrow::Cow::Owned(out)
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
    fn created_streams_are_named_after_their_topic() {
        assert_eq!(stream_name("order.events"), "order_events");
        assert_eq!(stream_name("a b/c"), "a_b_c");
    }

    #[test]
    fn server_errors_are_sorted_into_classes() {
        use ErrorCode as C;
        let full = "maximum messages exceeded (code 503, error code 10077)";
        assert_eq!(
            classify_server(503, C::STREAM_STORE_FAILED, full),
            Class::Refused
        );
        let disk = "insufficient storage resources available";
        assert_eq!(
            classify_server(503, C::STREAM_STORE_FAILED, disk),
            Class::Transient
        );
        assert_eq!(
            classify_server(400, C::STREAM_MESSAGE_EXCEEDS_MAXIMUM, "too big"),
            Class::Refused
        );
        assert_eq!(
            classify_server(503, C::CLUSTER_NOT_AVAILABLE, ""),
            Class::Transient
        );
        assert_eq!(classify_server(503, C(1), ""), Class::Transient);
        assert_eq!(
            classify_server(503, C::JETSTREAM_NOT_ENABLED, ""),
            Class::Operator
        );
        // Nobody classified it: an attempt, so that it cannot be retried forever.
        assert_eq!(classify_server(400, C(99_999), ""), Class::Refused);
    }

    #[test]
    fn cloud_events_values_are_percent_encoded() {
        assert_eq!(percent_encoded("/orders-service"), "/orders-service");
        assert_eq!(percent_encoded("a b\"%é"), "a%20b%22%25%C3%A9");
    }
}
