//! W3C trace context ([`traceparent` and `tracestate`](https://www.w3.org/TR/trace-context/))
//! carried with an event from the code that emitted it to the handlers that consume it.
//!
//! With the `opentelemetry` feature and a `tracing-opentelemetry` layer installed:
//!
//! - **At emit**, not at relay time: `emit` reads the OpenTelemetry context of the current
//!   `tracing` span and stores it in the row's headers as `traceparent` (and `tracestate`, if the
//!   context has one). Outside a traced span, nothing is stored. A `traceparent` given to
//!   `emit_with` wins over the captured one.
//! - **On the wire**: the relay sends them as Kafka headers, like any header stored with the row;
//!   `outbox replay` sends them again, and a retry or dead-letter topic keeps them. The trace is
//!   the emitting request's, not the relay's (the relay's batches are traces of their own).
//! - **At the consumer**, each handler runs in a span (`outbox_consume` in dedup mode,
//!   `outbox_inbox_row` in inbox mode) whose *parent* is the message's context, so the handler and
//!   everything it calls (a provider's client, its own emits) join the producer's trace. A parent
//!   rather than a link: one message has one producer, and a trace viewer shows the whole path as
//!   one tree. Invalid headers are ignored (a new trace starts), as the W3C recommendation asks.
//! - [`MessageMeta::otel_context`](crate::inbox::MessageMeta) gives the context for spans started
//!   outside `tracing`, and `context_from_headers(traceparent, tracestate)` turns an HTTP
//!   request's headers into a parent context, as the quickstart's `POST /orders` does.
//!
//! Without the feature, nothing is captured, and the headers are the application's like any
//! other: given to `emit_with`, they travel the same way, and a handler reads them with
//! [`MessageMeta::trace_parent`](crate::inbox::MessageMeta::trace_parent) (parsed, a
//! [`TraceParent`]) and `MessageMeta::tracestate`.
//!
//! Tested with the SDK's in-memory exporter (`tests/tests/trace_context.rs` in the repository):
//! the handler's span is the child of the span that emitted, in both modes, with the trace state
//! kept.
//!
//! # Seeing it in the quickstart
//!
//! `cargo run --example quickstart -- --trace` prints every span as it ends, on stderr,
//! `span trace=<trace id> span=<id> parent=<parent id> <name>` (then `event_id=<id>` on the
//! spans that have one). Each order is one trace across both services: `POST /orders` →
//! `outbox_consume` (the payments handler, whose parent is the request span, through the
//! `traceparent` header the relay sent) → `provider_charge` → `outbox_inbox_row` (the orders
//! side's handler, the child of the payments handler, which emitted `PaymentSucceeded` inside its
//! span).
//!
//! ```sh
//! cargo run --example quickstart -- --demo 1 --trace 2>&1 | grep '^span' | grep -v outbox_relay_batch
//! # or, serving, continue a trace of your own and follow it:
//! curl -s -H 'traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01' \
//!      -H 'content-type: application/json' -d '{"customer_id":"c1","product_id":"p1","amount":100}' \
//!      http://127.0.0.1:3000/orders     # and in the quickstart's output: grep 0af7651916cd43dd8448eb211c80319c
//! ```
//!
//! In a real service the spans go to a collector (opentelemetry-otlp's exporter in place of the
//! quickstart's printing span processor), where the same trace id shows the whole path.

use std::fmt;

/// The W3C trace-context header naming the trace and the span that emitted the event.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C trace-context header carrying vendors' trace state.
pub const TRACESTATE: &str = "tracestate";

/// A parsed `traceparent` header: the trace id, the id of the span that emitted the event
/// (the parent of the consumer's), and the trace flags (bit 0: sampled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    /// The trace's id (never 0).
    pub trace_id: u128,
    /// The emitting span's id (never 0).
    pub parent_id: u64,
    /// The trace flags.
    pub flags: u8,
}

/// `len` lowercase hex digits, as W3C trace context requires.
fn hex(field: &str, len: usize) -> Option<u128> {
    let lower = |c: u8| c.is_ascii_digit() || (b'a'..=b'f').contains(&c);
    (field.len() == len && field.bytes().all(lower))
        .then(|| u128::from_str_radix(field, 16).ok())
        .flatten()
}

impl TraceParent {
    /// Parses a `traceparent` value as the W3C recommendation says: version `00` with exactly
    /// four fields, or a later version (not `ff`) with at least four, of which the first four
    /// count; lowercase hex; trace id and parent id not all zeros. `None` for anything else: a
    /// consumer then starts a new trace, as the recommendation asks.
    ///
    /// ```
    /// use outbox_runtime::trace::TraceParent;
    /// let tp = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
    /// assert_eq!(tp.parent_id, 0x00f067aa0ba902b7);
    /// assert!(tp.is_sampled());
    /// assert_eq!(tp.to_string(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    /// assert!(TraceParent::parse("00-00000000000000000000000000000000-00f067aa0ba902b7-01").is_none());
    /// ```
    pub fn parse(header: &str) -> Option<TraceParent> {
        let mut fields = header.trim().split('-');
        let version = fields.next()?;
        let version = hex(version, 2)?;
        if version == 0xff {
            return None;
        }
        let trace_id = hex(fields.next()?, 32)?;
        let parent_id = u64::try_from(hex(fields.next()?, 16)?).ok()?;
        let flags = u8::try_from(hex(fields.next()?, 2)?).ok()?;
        if version == 0 && fields.next().is_some() {
            return None;
        }
        (trace_id != 0 && parent_id != 0).then_some(TraceParent {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// Whether the emitting side sampled (recorded) the trace.
    pub fn is_sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

impl fmt::Display for TraceParent {
    /// The header's value, version `00`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.parent_id, self.flags
        )
    }
}

/// The trace context of the current `tracing` span: its `traceparent`, and its `tracestate`
/// if it has one. `None` without an OpenTelemetry layer, or outside any span of one.
#[cfg(feature = "opentelemetry")]
pub(crate) fn current() -> Option<(String, Option<String>)> {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return None;
    }
    let parent = TraceParent {
        trace_id: u128::from_be_bytes(sc.trace_id().to_bytes()),
        parent_id: u64::from_be_bytes(sc.span_id().to_bytes()),
        flags: sc.trace_flags().to_u8(),
    };
    let state = sc.trace_state().header();
    Some((parent.to_string(), (!state.is_empty()).then_some(state)))
}

/// The OpenTelemetry context that `traceparent` and `tracestate` headers name (of an HTTP
/// request, say), as a remote parent: empty if there is no `traceparent` or it is not valid.
///
/// ```
/// use opentelemetry::trace::TraceContextExt as _;
/// let cx = outbox_runtime::trace::context_from_headers(
///     Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
///     Some("vendor=abc"),
/// );
/// assert!(cx.span().span_context().is_remote());
/// ```
#[cfg(feature = "opentelemetry")]
#[cfg_attr(docsrs, doc(cfg(feature = "opentelemetry")))]
pub fn context_from_headers(
    traceparent: Option<&str>,
    tracestate: Option<&str>,
) -> opentelemetry::Context {
    remote_context(traceparent.and_then(TraceParent::parse), tracestate)
}

/// The remote OpenTelemetry context a message's trace headers name (empty if they name none).
#[cfg(feature = "opentelemetry")]
pub(crate) fn remote_context(
    parent: Option<TraceParent>,
    state: Option<&str>,
) -> opentelemetry::Context {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    };

    let Some(parent) = parent else {
        return opentelemetry::Context::new();
    };
    // A tracestate that does not parse is dropped, the traceparent kept (as the
    // recommendation says).
    let state = state
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    let sc = SpanContext::new(
        TraceId::from_bytes(parent.trace_id.to_be_bytes()),
        SpanId::from_bytes(parent.parent_id.to_be_bytes()),
        TraceFlags::new(parent.flags),
        true,
        state,
    );
    opentelemetry::Context::new().with_remote_span_context(sc)
}

#[cfg(test)]
mod tests {
    use super::TraceParent;

    #[test]
    fn parses_what_the_recommendation_allows_and_nothing_else() {
        let ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let tp = TraceParent::parse(ok).unwrap();
        assert_eq!(tp.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(tp.to_string(), ok);
        assert!(
            !TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
                .unwrap()
                .is_sampled()
        );
        // A later version may add fields.
        assert!(TraceParent::parse(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"
        )
        .is_some());
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }
}
