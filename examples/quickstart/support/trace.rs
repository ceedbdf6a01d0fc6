//! The log and the spans: warnings (or `RUST_LOG`) on stderr, spans to OpenTelemetry, printed
//! with `--trace`.

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanProcessor};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

/// Installs the global subscriber: the relay's and consumers' warnings on stderr (`RUST_LOG`
/// chooses more), and every span at INFO or above to OpenTelemetry, whose spans
/// [`PrintSpans`] prints if `print_spans`.
pub fn init(print_spans: bool) {
    let mut provider = SdkTracerProvider::builder();
    if print_spans {
        provider = provider.with_span_processor(PrintSpans);
    }
    let provider = provider.build();
    let log = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(
            EnvFilter::builder()
                .with_default_directive(LevelFilter::WARN.into())
                .from_env_lossy(),
        );
    // The tracer keeps the provider (and its span processor) for as long as the subscriber.
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("quickstart"))
        .with_filter(LevelFilter::INFO);
    tracing_subscriber::registry().with(log).with(spans).init();
}

/// Prints each span as it ends, one line: its name, trace id, id and parent's id (with
/// `--trace`). Every span of one order has the same trace id.
#[derive(Debug)]
struct PrintSpans;

impl SpanProcessor for PrintSpans {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        let event_id = span
            .attributes
            .iter()
            .find(|kv| kv.key.as_str() == "event_id")
            .map(|kv| format!(" event_id={}", kv.value))
            .unwrap_or_default();
        eprintln!(
            "span trace={} span={} parent={} {}{event_id}",
            span.span_context.trace_id(),
            span.span_context.span_id(),
            span.parent_span_id,
            span.name,
        );
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}
