//! [`MessageMeta`]: what a handler may know of its message besides its event.

use std::borrow::Cow;

use uuid::Uuid;

/// What a handler may know of the message besides its event: where it was read, its headers,
/// its schema version, and which attempt this is. A handler asks for it with a `meta: &MessageMeta` parameter.
///
/// It borrows from the message (no copies on the consumer's path); keep what outlives the
/// handler with `to_owned`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageMeta<'a> {
    pub(crate) event_id: Uuid,
    pub(crate) event_type: Cow<'a, str>,
    pub(crate) topic: &'a str,
    pub(crate) partition: Option<i32>,
    pub(crate) offset: Option<i64>,
    pub(crate) key: Option<&'a [u8]>,
    pub(crate) headers: Vec<(&'a str, &'a [u8])>,
    pub(crate) attempt: u32,
    pub(crate) schema_version: u32,
}

impl<'a> MessageMeta<'a> {
    /// Metadata of a message that was not read off Kafka (a test's): `event_id` of
    /// `event_type` on `topic`, first attempt, no partition, offset, key or headers. Set the
    /// rest with the `with_*` methods.
    pub fn new(event_id: Uuid, event_type: &'a str, topic: &'a str) -> Self {
        MessageMeta {
            event_id,
            event_type: Cow::Borrowed(event_type),
            topic,
            partition: None,
            offset: None,
            key: None,
            headers: Vec::new(),
            attempt: 1,
            schema_version: 1,
        }
    }

    /// With this schema version (1 if never set).
    #[must_use]
    pub fn with_schema_version(mut self, version: u32) -> Self {
        self.schema_version = version.max(1);
        self
    }

    /// With this attempt number (1 for the first).
    #[must_use]
    pub fn with_attempt(mut self, attempt: u32) -> Self {
        self.attempt = attempt.max(1);
        self
    }

    /// With this partition key.
    #[must_use]
    pub fn with_key(mut self, key: &'a str) -> Self {
        self.key = Some(key.as_bytes());
        self
    }

    /// With these application headers, in this order.
    #[must_use]
    pub fn with_headers(mut self, headers: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        self.headers = headers
            .into_iter()
            .map(|(n, v)| (n, v.as_bytes()))
            .collect();
        self
    }

    /// The event's id (its `event_id` header): the deduplication key.
    pub fn event_id(&self) -> Uuid {
        self.event_id
    }

    /// The event's type (its `event_type` header).
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// The topic the event was published to. For a message read from a retry topic, the topic
    /// it was first read from (the one its handlers are registered for).
    pub fn topic(&self) -> &'a str {
        self.topic
    }

    /// The partition the message was read from: of `topic`, or, for a retried message, of the
    /// retry topic. `None` for an inbox row stored before version 0.1's migration 9, or a
    /// message made with [`new`](Self::new).
    pub fn partition(&self) -> Option<i32> {
        self.partition
    }

    /// The message's offset in that partition; `None` as for [`partition`](Self::partition).
    pub fn offset(&self) -> Option<i64> {
        self.offset
    }

    /// The message's key as text (the event's partition key, as the relay sends it); `None`
    /// if it has none or it is not UTF-8 (see [`key_bytes`](Self::key_bytes)).
    pub fn key(&self) -> Option<&'a str> {
        self.key.and_then(|k| std::str::from_utf8(k).ok())
    }

    /// The message's key as it came.
    pub fn key_bytes(&self) -> Option<&'a [u8]> {
        self.key
    }

    /// The application's headers (those given to `emit_with`, or another producer's) and, for
    /// a CloudEvent, its attributes (`ce_source`, `ce_id` as sent, `ce_time`, ...), in the
    /// message's order; none of the framework's own (`event_id`, `outbox_*`, ...).
    pub fn headers(&self) -> &[(&'a str, &'a [u8])] {
        &self.headers
    }

    /// The first of [`headers`](Self::headers) of this name, if its value is UTF-8: e.g.
    /// `header("ce_source")` for a CloudEvent's source.
    pub fn header(&self, name: &str) -> Option<&'a str> {
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    /// Which attempt at handling the message this is: 1 the first time, 2 after one failure,
    /// and so on (counted across retry topics, in-place retries and inbox retries).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The trace context the event was emitted in: its `traceparent` header, parsed (`None`
    /// without one, or if it is not valid W3C trace context). With the `opentelemetry`
    /// feature, the handler's span already has it as its parent.
    pub fn trace_parent(&self) -> Option<crate::trace::TraceParent> {
        self.header(crate::trace::TRACEPARENT)
            .and_then(crate::trace::TraceParent::parse)
    }

    /// Its `tracestate` header, as it came.
    pub fn tracestate(&self) -> Option<&'a str> {
        self.header(crate::trace::TRACESTATE)
    }

    /// The OpenTelemetry context the event was emitted in (a remote span context; empty if
    /// the message carries none), for a span the handler starts outside `tracing`.
    #[cfg(feature = "opentelemetry")]
    #[cfg_attr(docsrs, doc(cfg(feature = "opentelemetry")))]
    pub fn otel_context(&self) -> opentelemetry::Context {
        crate::trace::remote_context(self.trace_parent(), self.tracestate())
    }

    /// The schema version the event was sent with (its `outbox_schema_version` header; 1 if
    /// it has none). When an upcaster made the handler's event from an older payload, this is
    /// still the older version.
    pub fn schema_version(&self) -> u32 {
        self.schema_version
    }
}
/// `span`, a handler's span, with `meta`'s trace context as its parent (with the
/// `opentelemetry` feature and a context in the message; else as it is).
#[cfg(feature = "_broker")]
#[inline]
pub(crate) fn parented(span: tracing::Span, meta: &MessageMeta<'_>) -> tracing::Span {
    #[cfg(feature = "opentelemetry")]
    if let Some(parent) = meta.trace_parent() {
        use tracing_opentelemetry::OpenTelemetrySpanExt as _;
        // Fails only without an OpenTelemetry layer: nothing to parent then.
        let _ = span.set_parent(crate::trace::remote_context(
            Some(parent),
            meta.tracestate(),
        ));
    }
    #[cfg(not(feature = "opentelemetry"))]
    let _ = meta;
    span
}
