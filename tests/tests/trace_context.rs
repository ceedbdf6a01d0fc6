//! W3C trace context (`opentelemetry` feature), checked with an in-memory OpenTelemetry
//! exporter: the span that emitted an event and the handler that consumed it, through the
//! relay and the broker, are one trace, the handler's span a child of the emitting one.

use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TracerProvider as _,
};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_runtime::inbox::{Consumer, HandlerError, MessageMeta, Mode};
use outbox_runtime::testing::MockKafka;
use outbox_runtime::trace::{TraceParent, TRACEPARENT, TRACESTATE};
use outbox_runtime::{inbox_handler, OutboxEvent, Uow};
use outbox_tests::fixtures::{posted, Posted};
use outbox_tests::payments::wait_for;
use outbox_tests::{Running, TestDb};
use sqlx::PgConnection;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;

/// This test binary's exporter: every span ends up in it (spans of the tests running beside
/// each other are told apart by trace id).
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    &EXPORTER
        .get_or_init(|| {
            let exporter = InMemorySpanExporter::default();
            let provider = SdkTracerProvider::builder()
                .with_simple_exporter(exporter.clone())
                .build();
            let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-tests"));
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
                .expect("the only subscriber of this test binary");
            (exporter, provider)
        })
        .0
}

fn spans_of(trace: TraceId) -> Vec<SpanData> {
    exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.span_context.trace_id() == trace)
        .collect()
}

/// Calls "the payment provider" in a span of its own.
#[inbox_handler]
async fn charge(
    event: Posted,
    tx: &mut PgConnection,
    meta: &MessageMeta,
) -> Result<(), HandlerError> {
    assert!(
        meta.trace_parent().is_some(),
        "{:?} carries a trace",
        event.id
    );
    sqlx::query("SELECT 1")
        .execute(tx)
        .instrument(tracing::info_span!("charge_provider"))
        .await?;
    Ok(())
}

/// Emits in an "HTTP request" span (with a trace state), relays, consumes in `mode`: the
/// handler's span (`handler_span`) is the request's child, the provider call the handler's.
async fn one_trace_from_request_to_handler(mode: Mode, handler_span: &str) {
    exporter();
    let db = TestDb::new().await;
    let event = posted("L-1");
    // The request came with a trace context of its caller's, with a trace state.
    let caller = SpanContext::new(
        TraceId::from_bytes(uuid::Uuid::new_v4().as_u128().to_be_bytes()),
        SpanId::from_bytes(uuid::Uuid::new_v4().as_u64_pair().0.to_be_bytes()),
        TraceFlags::SAMPLED,
        true,
        "vendor=abc".parse().unwrap(),
    );
    let request = tracing::info_span!("http_request", route = "/orders");
    request
        .set_parent(opentelemetry::Context::new().with_remote_span_context(caller))
        .unwrap();
    let (trace, request_id) = {
        let sc = request.context().span().span_context().clone();
        (sc.trace_id(), sc.span_id())
    };
    async {
        let mut uow = Uow::begin(&db.pool).await.unwrap();
        uow.emit(&event).await.unwrap();
        uow.commit().await.unwrap();
    }
    .instrument(request.clone())
    .await;
    drop(request);

    // Stored at emit, with the request's span as the parent.
    let headers: serde_json::Value =
        sqlx::query_scalar("SELECT headers FROM outbox_event WHERE event_id = $1")
            .bind(event.id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let parent = TraceParent::parse(headers[TRACEPARENT].as_str().unwrap()).unwrap();
    assert_eq!(parent.trace_id.to_be_bytes(), trace.to_bytes());
    assert_eq!(parent.parent_id.to_be_bytes(), request_id.to_bytes());

    let kafka = MockKafka::start().unwrap();
    kafka.create_topic(Posted::TOPIC, 1).unwrap();
    assert_eq!(kafka.relay_pending(&db.pool).await.unwrap(), 1);
    let records = kafka.records(Posted::TOPIC).await.unwrap();
    assert_eq!(
        records[0].header(TRACEPARENT),
        Some(parent.to_string().as_str())
    );
    assert_eq!(records[0].header(TRACESTATE), Some("vendor=abc"));

    let consumer = Consumer::builder(db.pool.clone())
        .brokers(kafka.bootstrap_servers())
        .group_id("payments")
        .handler(charge)
        .mode(mode)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for(
        "the provider call's span",
        Duration::from_secs(30),
        || async { spans_of(trace).iter().any(|s| s.name == "charge_provider") },
    )
    .await;
    running.stop().await;

    let spans = spans_of(trace);
    let named = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("a `{name}` span in the trace: {spans:#?}"))
    };
    let handled = named(handler_span);
    assert_eq!(handled.parent_span_id, request_id);
    assert_eq!(
        handled.span_context.trace_state().get("vendor"),
        Some("abc")
    );
    assert_eq!(
        named("charge_provider").parent_span_id,
        handled.span_context.span_id()
    );
    assert_ne!(handled.span_context.span_id(), SpanId::INVALID);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_mode_handlers_join_the_emitting_requests_trace() {
    one_trace_from_request_to_handler(Mode::Dedup, "outbox_consume").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_mode_handlers_join_the_emitting_requests_trace() {
    one_trace_from_request_to_handler(Mode::Inbox, "outbox_inbox_row").await;
}

#[tokio::test]
async fn no_span_no_header_and_the_applications_traceparent_wins() {
    exporter();
    let db = TestDb::new().await;
    let (outside, given) = (posted("L-1"), posted("L-2"));
    let mine = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    async {
        let mut uow = Uow::begin(&db.pool).await.unwrap();
        uow.emit_with(&given, [(TRACEPARENT, mine)]).await.unwrap();
        uow.commit().await.unwrap();
    }
    .instrument(tracing::info_span!("http_request"))
    .await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit(&outside).await.unwrap();
    uow.commit().await.unwrap();
    let headers = |id: uuid::Uuid| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, serde_json::Value>(
                "SELECT headers FROM outbox_event WHERE event_id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(headers(outside.id).await, serde_json::json!({}));
    assert_eq!(
        headers(given.id).await,
        serde_json::json!({ TRACEPARENT: mine })
    );
}
