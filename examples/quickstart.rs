//! Quickstart: an orders service and a payments service that talk through Kafka, each with its
//! own database and its own outbox, in one process.
//!
//! ```sh
//! cargo run --example quickstart                           # serve on 127.0.0.1:3000, until Ctrl-C
//! cargo run --example quickstart -- --listen 127.0.0.1:0  # on a free port (printed)
//! cargo run --example quickstart -- --demo 200            # post 200 orders, wait until paid, exit
//! cargo run --example quickstart -- --demo 1 --trace      # and print every span: one trace per order
//! ```
//!
//! It prints the address it listens on and `curl` commands to try.
//!
//! What happens to an order:
//!
//! ```text
//!  POST /orders ─► orders database: `orders` row + `OrderCreated` outbox row, one transaction
//!                   │ orders relay
//!                   ▼
//!  Kafka `order.events` ─► payments consumer (dedup mode, its state: a payment-provider
//!                            client) ─► provider charge (idempotency key: the event id),
//!                            then the payments database: `payments` row (with the charge and
//!                            the attempt) + `PaymentSucceeded` outbox row, one transaction
//!                            (a provider timeout: retried through `order.events.retry`)
//!                   ┌───────────────────────────────────────────┘ payments relay
//!                   ▼
//!  Kafka `payment.events` ─► orders consumer (inbox mode) ─► orders.payment_status = 'paid'
//!
//!  GET /orders/{id} ─► the order, `"payment_status": "pending"`, a moment later `"paid"`
//! ```
//!
//! Each order is one trace, from `POST /orders` (a child of the caller's `traceparent`, if it
//! sent one) to the orders consumer: `emit` stores the request span's trace context with the
//! event, the relay sends it as the `traceparent` header, and the consumers' handler spans are
//! its children, so the payments service's own `PaymentSucceeded` carries it on. `--trace`
//! prints each span as it ends.
//!
//! No request handler talks to Kafka: a handler only writes rows, and the relays publish the
//! committed outbox rows. A consumer runs its handler in a database transaction together with
//! its deduplication (or inbox) row, so a redelivered event has no second effect.
//!
//! Configuration (all optional):
//!
//! - `DATABASE_URL`: the orders database, default
//!   `postgres://postgres@127.0.0.1:5432/outbox_quickstart`. The payments service uses the
//!   database of the same name plus `_payments` on the same server. Both are created if they do
//!   not exist, and both get the outbox migrations and their own tables.
//! - `KAFKA_BROKERS`: a Kafka to use; by default an embedded one (librdkafka's mock cluster,
//!   inside this process, gone when it exits).
//!
//! Ctrl-C shuts down gracefully: the HTTP server finishes the requests in flight, then the
//! relays and consumers finish their batch in hand and stop.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanProcessor};
use outbox_runtime::trace;
use std::error::Error;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::time::{Duration, Instant};
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use outbox_runtime::inbox::{Consumer, HandlerError, MessageMeta, Mode};
use outbox_runtime::relay::Relay;
use outbox_runtime::{inbox_handler, OutboxEvent, Uow};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{BaseProducer, Producer as _};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientConfig;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgConnection, PgPool};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

type BoxError = Box<dyn Error + Send + Sync>;
type Result<T, E = BoxError> = std::result::Result<T, E>;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/outbox_quickstart";
/// Partitions of each topic the quickstart creates.
const PARTITIONS: i32 = 4;
/// How long `--demo` waits for every order to be paid.
const DEMO_TIMEOUT: Duration = Duration::from_secs(60);
/// Keep-alive connections `--demo` posts its orders over, concurrently.
const DEMO_CONNECTIONS: usize = 4;

// ---------------------------------------------------------------------------------------------
// The events. Each names its Kafka topic; the key (the partition key) keeps one order's events
// in order.

/// Emitted by the orders service when an order is placed; the key is the order id.
#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(
    topic = "order.events",
    aggregate_type = "Order",
    event_type = "OrderCreated"
)]
struct OrderCreated {
    #[outbox(aggregate_id)]
    order_id: Uuid,
    customer_id: String,
    product_id: String,
    amount: i64,
}

/// Emitted by the payments service when it charged an order; keyed by the order id too.
#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(
    topic = "payment.events",
    aggregate_type = "Payment",
    event_type = "PaymentSucceeded"
)]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    payment_id: Uuid,
    #[outbox(key)]
    order_id: Uuid,
    amount: i64,
}

// ---------------------------------------------------------------------------------------------
// The orders service: an HTTP API on the orders database.

/// `POST /orders` body.
#[derive(Debug, Deserialize)]
struct NewOrder {
    customer_id: String,
    product_id: String,
    /// In cents; must be positive.
    amount: i64,
}

/// `GET /orders/{id}` answer.
#[derive(Debug, Serialize)]
struct OrderView {
    order_id: Uuid,
    customer_id: String,
    product_id: String,
    amount: i64,
    /// `pending` until the payment arrived, then `paid`.
    payment_status: String,
}

fn orders_api(orders_db: PgPool) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(get_order))
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "no such route: try POST /orders or GET /orders/{id}",
            )
        })
        .with_state(orders_db)
}

/// `POST /orders`: 201 `{"order_id": ...}`. Runs in a span of its own, the child of the
/// caller's trace context if the request carries one; the order's event carries it on.
async fn create_order(
    State(db): State<PgPool>,
    headers: axum::http::HeaderMap,
    body: Result<Json<NewOrder>, JsonRejection>,
) -> Result<impl IntoResponse, ApiError> {
    let span = tracing::info_span!("POST /orders");
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let caller = trace::context_from_headers(header(trace::TRACEPARENT), header(trace::TRACESTATE));
    // Fails only without an OpenTelemetry layer; `main` installs one.
    let _ = span.set_parent(caller);
    create_order_in_span(db, body).instrument(span).await
}

async fn create_order_in_span(
    db: PgPool,
    body: Result<Json<NewOrder>, JsonRejection>,
) -> Result<impl IntoResponse, ApiError> {
    // Bad JSON is a 400, JSON of the wrong shape a 422 (axum's rejection knows which).
    let Json(order) = body?;
    if order.amount <= 0 {
        let message = format!("amount must be positive, not {}", order.amount);
        return Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, message));
    }
    if order.customer_id.trim().is_empty() || order.product_id.trim().is_empty() {
        let message = "customer_id and product_id must not be empty";
        return Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, message));
    }
    let order_id = place_order(&db, order).await?;
    let location = format!("/orders/{order_id}");
    let body = Json(serde_json::json!({ "order_id": order_id }));
    Ok((StatusCode::CREATED, [(header::LOCATION, location)], body))
}

/// The command: the order row and its `OrderCreated` event commit together, or neither does.
async fn place_order(db: &PgPool, order: NewOrder) -> outbox_runtime::Result<Uuid> {
    let order_id = Uuid::now_v7();
    let mut uow = Uow::begin(db).await?;
    sqlx::query("INSERT INTO orders (id, customer_id, product_id, amount) VALUES ($1, $2, $3, $4)")
        .bind(order_id)
        .bind(&order.customer_id)
        .bind(&order.product_id)
        .bind(order.amount)
        .execute(uow.tx())
        .await?;
    uow.emit(&OrderCreated {
        order_id,
        customer_id: order.customer_id,
        product_id: order.product_id,
        amount: order.amount,
    })
    .await?;
    uow.commit().await?;
    Ok(order_id)
}

/// `GET /orders/{id}`: the order and its payment status.
async fn get_order(
    State(db): State<PgPool>,
    Path(id): Path<String>,
) -> Result<Json<OrderView>, ApiError> {
    let order_id = Uuid::parse_str(&id).map_err(|_| {
        let message = format!("`{id}` is not an order id (a UUID)");
        ApiError::new(StatusCode::BAD_REQUEST, message)
    })?;
    let row: Option<(String, String, i64, String)> = sqlx::query_as(
        "SELECT customer_id, product_id, amount, payment_status FROM orders WHERE id = $1",
    )
    .bind(order_id)
    .fetch_optional(&db)
    .await?;
    let (customer_id, product_id, amount, payment_status) =
        row.ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no order {order_id}")))?;
    Ok(Json(OrderView {
        order_id,
        customer_id,
        product_id,
        amount,
        payment_status,
    }))
}

/// The orders service learns of payments: runs in the orders consumer's transaction (inbox mode:
/// the event was stored in `inbox_event` first, and a processor runs this once).
#[inbox_handler]
async fn mark_order_paid(
    event: PaymentSucceeded,
    tx: &mut PgConnection,
) -> Result<(), HandlerError> {
    let updated = sqlx::query("UPDATE orders SET payment_status = 'paid' WHERE id = $1")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    if updated.rows_affected() == 0 {
        // Retrying cannot help: the row is kept as dead in `inbox_event` for an operator.
        let message = format!("payment for unknown order {}", event.order_id);
        return Err(HandlerError::permanent(message));
    }
    Ok(())
}

/// An error answer: a status and `{"error": "..."}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }

    /// The details (the error and its causes) go to the log, not to the client.
    fn internal(error: impl Error + 'static) -> Self {
        eprintln!("internal error: {}", outbox_runtime::error_chain(&error));
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal error; see the server's log",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(serde_json::json!({ "error": self.message }));
        (self.status, body).into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        ApiError::new(rejection.status(), rejection.body_text())
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        ApiError::internal(error)
    }
}

impl From<outbox_runtime::Error> for ApiError {
    fn from(error: outbox_runtime::Error) -> Self {
        ApiError::internal(error)
    }
}

// ---------------------------------------------------------------------------------------------
// The payments service: no API, only a consumer of `OrderCreated`, on its own database.

/// The payments service's application state: what its handlers need besides the event and
/// the transaction. The consumer holds it (`.state(...)`) and lends it to every call.
struct Payments {
    provider: PaymentProvider,
}

/// A payment provider's client. Here an in-process stand-in for a remote API with idempotency
/// keys (as Stripe's or Adyen's): a charge repeated with the same key is the same charge.
/// Like a real one it sometimes times out after charging: every tenth new charge here.
#[derive(Default)]
struct PaymentProvider {
    /// Charges made, by idempotency key.
    charges: std::sync::Mutex<std::collections::HashMap<Uuid, String>>,
}

/// The provider's answer did not come: the charge may or may not have been made.
#[derive(Debug)]
struct ProviderTimeout;

impl fmt::Display for ProviderTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the payment provider did not answer in time")
    }
}

impl Error for ProviderTimeout {}

impl PaymentProvider {
    /// Charges `amount`, once per `idempotency_key`; returns the provider's charge id.
    async fn charge(&self, idempotency_key: Uuid, amount: i64) -> Result<String, ProviderTimeout> {
        let mut charges = self.charges.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(charge) = charges.get(&idempotency_key) {
            return Ok(charge.clone());
        }
        let charge = format!("ch_{}_{amount}", charges.len() + 1);
        charges.insert(idempotency_key, charge.clone());
        #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` needs Rust 1.87, above the MSRV
        if charges.len() % 10 == 0 {
            return Err(ProviderTimeout); // charged, but the answer was lost
        }
        Ok(charge)
    }
}

/// Charges an order. Runs in the payments consumer's transaction, which also holds the
/// deduplication row (`processed_event`): a redelivered `OrderCreated` is skipped, and the
/// payment row and its `PaymentSucceeded` event commit together, or neither does.
///
/// The provider is outside that transaction, so its call is made idempotent with the event's
/// id: when the provider times out, the handler fails retryably, the consumer tries the event
/// again (through `order.events.retry`), and the second call returns the charge the first one
/// made. The attempt number comes from the message's metadata.
#[inbox_handler]
async fn charge_order(
    event: OrderCreated,
    tx: &mut PgConnection,
    payments: &Payments,
    meta: &MessageMeta,
) -> Result<(), HandlerError> {
    // This runs in the consumer's span, a child of `POST /orders` (through the `traceparent`
    // header); the provider call gets a span of its own.
    let charge = payments
        .provider
        .charge(meta.event_id(), event.amount)
        .instrument(tracing::info_span!(
            "provider_charge",
            attempt = meta.attempt()
        ))
        .await
        .map_err(HandlerError::retryable)?;
    let payment_id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO payments (id, order_id, amount, provider_charge, attempt) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(payment_id)
    .bind(event.order_id)
    .bind(event.amount)
    .bind(charge)
    .bind(meta.attempt() as i32)
    .execute(&mut *tx)
    .await?;
    // The payments service's own outbox, in the same transaction; its relay publishes it.
    let succeeded = PaymentSucceeded {
        payment_id,
        order_id: event.order_id,
        amount: event.amount,
    };
    outbox_runtime::emit(tx, &succeeded).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Wiring: databases, Kafka, background workers, the server, and the shutdown.

#[tokio::main]
async fn main() -> Result<(), Report> {
    let Some(args) = Args::parse(std::env::args().skip(1)).map_err(Report::usage)? else {
        println!("{USAGE}");
        return Ok(());
    };
    // The relay's and consumers' warnings (a broker down, a retried handler) on stderr;
    // RUST_LOG=info (or debug) shows more. Spans also go to OpenTelemetry (printed with
    // `--trace`; a real service exports them, with opentelemetry-otlp say).
    let mut provider = SdkTracerProvider::builder();
    if args.trace {
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
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("quickstart"))
        .with_filter(LevelFilter::INFO);
    tracing_subscriber::registry().with(log).with(spans).init();
    run(args).await.map_err(Report)
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

async fn run(args: Args) -> Result<()> {
    let (orders_db, payments_db) = databases().await?;

    // Kafka, with the topics, the payments consumer's retry topic and the dead-letter topics.
    let topics = [
        OrderCreated::TOPIC,
        "order.events.retry",
        "order.events.dlq",
        PaymentSucceeded::TOPIC,
        "payment.events.dlq",
    ];
    let kafka = Kafka::start(&topics).await?;
    let brokers = kafka.bootstrap();

    // Background workers: one relay per outbox, one consumer per service.
    let orders_relay = Relay::builder(orders_db.clone())
        .brokers(&brokers)
        .build()?;
    let payments_relay = Relay::builder(payments_db.clone())
        .brokers(&brokers)
        .build()?;
    let payments_consumer = Consumer::builder(payments_db.clone())
        .brokers(&brokers)
        .group_id("quickstart-payments")
        .state(Payments {
            provider: PaymentProvider::default(),
        })
        .handler(charge_order) // Mode::Dedup, the default
        .build()?;
    let orders_consumer = Consumer::builder(orders_db.clone())
        .brokers(&brokers)
        .group_id("quickstart-orders")
        .handler(mark_order_paid)
        .mode(Mode::Inbox)
        .processors(2)
        .build()?;

    // `shutdown` stops the server (on Ctrl-C, at the end of `--demo`, or when a worker failed);
    // `stop` then stops the workers.
    let shutdown = CancellationToken::new();
    let stop = CancellationToken::new();
    let workers = [
        ("orders relay", orders_relay.spawn(stop.clone())),
        ("payments relay", payments_relay.spawn(stop.clone())),
        ("payments consumer", payments_consumer.spawn(stop.clone())),
        ("orders consumer", orders_consumer.spawn(stop.clone())),
    ]
    .map(|(name, task)| Worker::spawn(name, task, &shutdown));
    tokio::spawn(shutdown_on_ctrl_c(shutdown.clone()));

    // The HTTP server.
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = reachable(listener.local_addr()?);
    let server = {
        let app = orders_api(orders_db.clone());
        let stopped = shutdown.clone().cancelled_owned();
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(stopped)
                .await
        })
    };
    println!("orders API listening on http://{addr}");

    // Serve until Ctrl-C, or run the demo and stop.
    let mut problems = Vec::new();
    match args.demo {
        None => {
            print_try_it(addr);
            shutdown.cancelled().await;
        }
        Some(n) => {
            tokio::select! {
                result = demo(addr, &orders_db, n) => {
                    if let Err(e) = result {
                        problems.push(format!("demo: {e}"));
                    }
                }
                () = shutdown.cancelled() => problems.push("demo: interrupted".to_owned()),
            }
        }
    }

    // Graceful shutdown: the server first (requests in flight finish), then the workers.
    println!("shutting down");
    shutdown.cancel();
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => problems.push(format!("HTTP server: {e}")),
        Err(e) => problems.push(format!("HTTP server: {e}")),
    }
    stop.cancel();
    for worker in workers {
        if let Err(e) = worker.stop().await {
            problems.push(e);
        }
    }
    drop(kafka); // the embedded mock cluster, if any, goes last
    if problems.is_empty() {
        println!("stopped");
        Ok(())
    } else {
        Err(problems.join("; ").into())
    }
}

fn print_try_it(addr: SocketAddr) {
    let post = format!("curl -si http://{addr}/orders -H 'content-type: application/json' -d");
    let order = r#"{"customer_id": "c-1", "product_id": "book-42", "amount": 1500}"#;
    println!();
    println!("try:");
    println!("  {post} '{order}'");
    println!("  curl -s http://{addr}/orders/ORDER_ID   # payment_status: pending, then paid");
    println!("  {post} '{}'   # 422", order.replace("1500", "0"));
    println!();
    println!("Ctrl-C stops it.");
}

/// Fires `shutdown` on Ctrl-C (SIGINT).
async fn shutdown_on_ctrl_c(shutdown: CancellationToken) {
    tokio::select! {
        signal = tokio::signal::ctrl_c() => match signal {
            Ok(()) => {
                println!("Ctrl-C received");
                shutdown.cancel();
            }
            Err(e) => eprintln!("cannot listen for Ctrl-C: {e}"),
        },
        () = shutdown.cancelled() => {}
    }
}

/// A background task (relay or consumer). They run until told to stop; one that stops by
/// itself has failed, and then the whole application shuts down.
struct Worker {
    name: &'static str,
    task: JoinHandle<Result<(), String>>,
}

impl Worker {
    fn spawn(
        name: &'static str,
        task: JoinHandle<outbox_runtime::Result<()>>,
        shutdown: &CancellationToken,
    ) -> Worker {
        let shutdown = shutdown.clone();
        let task = tokio::spawn(async move {
            let result = match task.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!(
                    "{name} failed: {}",
                    outbox_runtime::error_chain(&e)
                )),
                Err(e) => Err(format!("{name} panicked: {e}")),
            };
            if let Err(e) = &result {
                eprintln!("{e}; shutting down");
            }
            shutdown.cancel();
            result
        });
        Worker { name, task }
    }

    /// Waits for the worker to finish (after its token was cancelled).
    async fn stop(self) -> Result<(), String> {
        match tokio::time::timeout(Duration::from_secs(30), self.task).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(format!("{} panicked: {e}", self.name)),
            Err(_) => Err(format!("{} did not stop within 30 s", self.name)),
        }
    }
}

/// The orders service's database (`DATABASE_URL`) and the payments service's (same name +
/// `_payments`), created if need be, with the outbox migrations and their tables.
async fn databases() -> Result<(PgPool, PgPool)> {
    let url = std::env::var("DATABASE_URL")
        .ok()
        .filter(|url| !url.is_empty())
        .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned());
    let orders_options = PgConnectOptions::from_str(&url)
        .map_err(|e| format!("DATABASE_URL `{url}` is not a PostgreSQL URL: {e}"))?
        .disable_statement_logging();
    let orders_name = orders_options
        .get_database()
        .ok_or("DATABASE_URL must name a database, as in postgres://host/outbox_quickstart")?
        .to_owned();
    let payments_options = orders_options
        .clone()
        .database(&format!("{orders_name}_payments"));
    let orders_db = connect_creating(&orders_options).await?;
    let payments_db = connect_creating(&payments_options).await?;
    outbox_runtime::migrate(&orders_db).await?;
    outbox_runtime::migrate(&payments_db).await?;
    create_tables(&orders_db, &orders_name, &payments_db).await?;
    Ok((orders_db, payments_db))
}

/// The orders service's `orders` table and the payments service's `payments` table.
async fn create_tables(orders_db: &PgPool, orders_name: &str, payments_db: &PgPool) -> Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (
            id uuid PRIMARY KEY,
            customer_id text NOT NULL,
            product_id text NOT NULL,
            amount bigint NOT NULL CHECK (amount > 0),
            payment_status text NOT NULL DEFAULT 'pending',
            created_at timestamptz NOT NULL DEFAULT now()
        )",
    )
    .execute(orders_db)
    .await?;
    // An `orders` table of another shape (an older quickstart's, say) would fail every insert.
    let columns: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.columns
         WHERE table_schema = current_schema() AND table_name = 'orders'
           AND (column_name, data_type) IN (('customer_id', 'text'), ('product_id', 'text'),
                                            ('amount', 'bigint'), ('payment_status', 'text'))",
    )
    .fetch_one(orders_db)
    .await?;
    if columns != 4 {
        let message = format!(
            "database {orders_name} already has an `orders` table of another shape (from an \
             older quickstart?): drop it, or set DATABASE_URL to another database"
        );
        return Err(message.into());
    }
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS payments (
            id uuid PRIMARY KEY,
            order_id uuid NOT NULL UNIQUE,
            amount bigint NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now()
        )",
    )
    .execute(payments_db)
    .await?;
    // Added after the first quickstart: the provider's charge and the attempt that made it.
    sqlx::query(
        "ALTER TABLE payments ADD COLUMN IF NOT EXISTS provider_charge text, \
             ADD COLUMN IF NOT EXISTS attempt integer",
    )
    .execute(payments_db)
    .await?;
    Ok(())
}

/// Connects to the database `options` names, creating it first if it does not exist.
async fn connect_creating(options: &PgConnectOptions) -> Result<PgPool> {
    let name = options.get_database().unwrap_or_default().to_owned();
    let server = format!("{}:{}", options.get_host(), options.get_port());
    let cannot_reach = |e: sqlx::Error| {
        format!("cannot reach PostgreSQL at {server}: {e} (start it, or set DATABASE_URL)")
    };
    // One connection first: it tells whether the database exists, and fails fast and clearly.
    match options.connect().await {
        Ok(_) => {}
        // 3D000: invalid_catalog_name, the database does not exist.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("3D000") => {
            if name.len() > 63 {
                let message =
                    format!("database name `{name}` is longer than PostgreSQL's 63 bytes");
                return Err(message.into());
            }
            let mut admin = options
                .clone()
                .database("postgres")
                .connect()
                .await
                .map_err(cannot_reach)?;
            let quoted = format!("\"{}\"", name.replace('"', "\"\""));
            match sqlx::query(&format!("CREATE DATABASE {quoted}"))
                .execute(&mut admin)
                .await
            {
                Ok(_) => println!("created database {name}"),
                // 42P04: duplicate_database, created meanwhile by someone else.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {}
                Err(e) => return Err(format!("cannot create database {name}: {e}").into()),
            }
        }
        Err(e) => return Err(cannot_reach(e).into()),
    }
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .connect_with(options.clone())
        .await
        .map_err(cannot_reach)?;
    Ok(pool)
}

/// The Kafka the services talk through.
enum Kafka {
    /// librdkafka's mock cluster, inside this process; it lives as long as this client.
    Mock(BaseProducer),
    /// `KAFKA_BROKERS`.
    External(String),
}

impl Kafka {
    /// `KAFKA_BROKERS` or a new mock cluster, with `topics` created.
    async fn start(topics: &[&str]) -> Result<Kafka> {
        let kafka = match std::env::var("KAFKA_BROKERS") {
            Ok(brokers) if !brokers.is_empty() => {
                create_topics(&brokers, topics).await?;
                Kafka::External(brokers)
            }
            _ => Kafka::mock(topics)?,
        };
        println!("Kafka at {}", kafka.bootstrap());
        Ok(kafka)
    }

    /// A mock cluster of one broker, with `topics`.
    fn mock(topics: &[&str]) -> Result<Kafka> {
        let owner: BaseProducer = ClientConfig::new()
            .set("test.mock.num.brokers", "1")
            .create()?;
        form_groups_at_once(&owner);
        let cluster = owner
            .client()
            .mock_cluster()
            .ok_or("librdkafka did not start a mock cluster")?;
        for topic in topics {
            cluster.create_topic(topic, PARTITIONS, 1)?;
        }
        drop(cluster);
        Ok(Kafka::Mock(owner))
    }

    fn bootstrap(&self) -> String {
        match self {
            Kafka::Mock(owner) => owner
                .client()
                .mock_cluster()
                .map(|cluster| cluster.bootstrap_servers())
                .unwrap_or_default(),
            Kafka::External(brokers) => brokers.clone(),
        }
    }
}

/// The mock cluster waits 3 s before it forms a consumer group (as Kafka's
/// `group.initial.rebalance.delay.ms` does); the quickstart's consumers need not wait.
fn form_groups_at_once(owner: &BaseProducer) {
    // SAFETY: the pointers are `owner`'s live client and its mock cluster; `owner` outlives
    // this call.
    unsafe {
        let cluster = rdkafka_sys::rd_kafka_handle_mock_cluster(owner.client().native_ptr());
        if !cluster.is_null() {
            rdkafka_sys::rd_kafka_mock_group_initial_rebalance_delay_ms(cluster, 0);
        }
    }
}

/// Creates `topics` on a real Kafka; topics that exist already are fine.
async fn create_topics(brokers: &str, topics: &[&str]) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|topic| NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results =
        tokio::time::timeout(Duration::from_secs(30), admin.create_topics(&new, &options))
            .await
            .map_err(|_| format!("Kafka at {brokers} did not answer within 30 s"))?
            .map_err(|e| format!("cannot create topics on Kafka at {brokers}: {e}"))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => return Err(format!("cannot create topic {topic}: {code}").into()),
        }
    }
    Ok(())
}

/// A listening address as a client can reach it: 0.0.0.0 and [::] become the loopback.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
}

// ---------------------------------------------------------------------------------------------
// `--demo N`: a client of the API, over real HTTP.

/// Posts `n` orders to the API at `addr`, then waits until all are paid.
async fn demo(addr: SocketAddr, orders_db: &PgPool, n: usize) -> Result<()> {
    let started = Instant::now();
    let connections = DEMO_CONNECTIONS.min(n);
    let mut clients = Vec::with_capacity(connections);
    for c in 0..connections {
        // Connection `c` posts orders c, c + connections, c + 2 * connections, ...
        let orders: Vec<usize> = (c..n).step_by(connections).collect();
        clients.push(tokio::spawn(post_orders(addr, orders)));
    }
    let mut ids = Vec::with_capacity(n);
    for client in clients {
        ids.extend(client.await??);
    }
    println!(
        "demo: posted {n} orders over {connections} connections in {:.2} s; waiting for payments",
        started.elapsed().as_secs_f64()
    );

    let deadline = started + DEMO_TIMEOUT;
    loop {
        let paid: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM orders WHERE id = ANY($1) AND payment_status = 'paid'",
        )
        .bind(&ids)
        .fetch_one(orders_db)
        .await?;
        let elapsed = started.elapsed().as_secs_f64();
        if paid as usize == n {
            println!("demo: {paid}/{n} orders paid in {elapsed:.2} s");
            return Ok(());
        }
        if Instant::now() >= deadline {
            println!("demo: {paid}/{n} orders paid in {elapsed:.2} s (timed out)");
            return Err(
                format!("only {paid} of {n} orders were paid within {DEMO_TIMEOUT:?}").into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Posts one order per entry of `orders` on one keep-alive connection; returns their ids.
async fn post_orders(addr: SocketAddr, orders: Vec<usize>) -> Result<Vec<Uuid>> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    // Drives the connection; it ends when `sender` is dropped.
    tokio::spawn(connection);

    #[derive(Deserialize)]
    struct Created {
        order_id: Uuid,
    }
    let mut ids = Vec::with_capacity(orders.len());
    for i in orders {
        let body = serde_json::json!({
            "customer_id": format!("customer-{}", i % 10),
            "product_id": format!("product-{}", i % 7),
            "amount": 100 + i,
        });
        let request = hyper::Request::post("/orders")
            .header(header::HOST, addr.to_string())
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))?;
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        if status != StatusCode::CREATED {
            let body = String::from_utf8_lossy(&body);
            return Err(format!("POST /orders answered {status}: {body}").into());
        }
        ids.push(serde_json::from_slice::<Created>(&body)?.order_id);
    }
    Ok(ids)
}

// ---------------------------------------------------------------------------------------------
// Command line.

const USAGE: &str = "\
usage: cargo run --example quickstart -- [--listen ADDR] [--demo N] [--trace]

  --listen ADDR   serve the orders API on ADDR (default 127.0.0.1:3000; port 0: a free port)
  --demo N        post N orders to the API, wait until all are paid, print the time, stop
  --trace         print every span as it ends (stderr): each order's spans share a trace id
  --help          this text

environment:
  DATABASE_URL    orders database (default postgres://postgres@127.0.0.1:5432/outbox_quickstart);
                  the payments service uses the same name + `_payments`; both are created
  KAFKA_BROKERS   a Kafka to use (default: an embedded mock cluster)";

#[derive(Debug)]
struct Args {
    listen: SocketAddr,
    demo: Option<usize>,
    trace: bool,
}

impl Args {
    /// The arguments, or `None` for `--help`.
    fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
        let mut parsed = Args {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 3000)),
            demo: None,
            trace: false,
        };
        while let Some(arg) = args.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((flag, value)) => (flag.to_owned(), Some(value.to_owned())),
                None => (arg.clone(), None),
            };
            let mut value = || {
                inline
                    .clone()
                    .or_else(|| args.next())
                    .ok_or_else(|| format!("`{flag}` needs a value"))
            };
            match flag.as_str() {
                "--listen" => {
                    let value = value()?;
                    parsed.listen = value.parse().map_err(|_| {
                        format!("`--listen {value}`: not an address such as 127.0.0.1:3000")
                    })?;
                }
                "--demo" => {
                    let value = value()?;
                    match value.parse::<usize>() {
                        Ok(n) if n > 0 => parsed.demo = Some(n),
                        _ => {
                            return Err(format!(
                                "`--demo {value}`: not a number of orders (1 or more)"
                            ))
                        }
                    }
                }
                "--trace" if inline.is_none() => parsed.trace = true,
                "-h" | "--help" => return Ok(None),
                _ => return Err(format!("unknown argument `{arg}`")),
            }
        }
        Ok(Some(parsed))
    }
}

/// What a failed `main` returns. Rust prints it with `{:?}` after `Error: `, so its `Debug` is
/// the message and its causes, not a data structure.
struct Report(BoxError);

impl Report {
    fn usage(problem: String) -> Report {
        Report(format!("{problem}\n\n{USAGE}").into())
    }
}

impl fmt::Debug for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", outbox_runtime::error_chain(&*self.0))
    }
}
