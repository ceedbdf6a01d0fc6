//! Quickstart: an orders service and a payments service that talk through Kafka (or NATS
//! JetStream: `--transport nats`), each with its own database and its own outbox, in one
//! process.
//!
//! ```sh
//! cargo run --example quickstart                           # serve on 127.0.0.1:3000, until Ctrl-C
//! cargo run --example quickstart -- --listen 127.0.0.1:0  # on a free port (printed)
//! cargo run --example quickstart -- --demo 200            # post 200 orders, wait until paid, exit
//! cargo run --example quickstart -- --demo 1 --trace      # and print every span: one trace per order
//! cargo run --example quickstart -- --console 127.0.0.1:3001  # and the operator console
//! cargo run --example quickstart -- --transport nats       # through nats-server -js (NATS_URL)
//! cargo run --example quickstart -- --transport rabbitmq   # through RabbitMQ (RABBITMQ_URL)
//! cargo run --example quickstart -- --database mariadb     # on MariaDB or MySQL (mariadb.rs)
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
//!                            (a provider timeout: retried through `order.events.retry`,
//!                            on NATS redelivered after a delay)
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
//!   `postgres://postgres@127.0.0.1:5432/outbox_quickstart` (with `--database mariadb`:
//!   `mysql://outbox:outbox@127.0.0.1:3306/outbox_quickstart`). The payments service uses the
//!   database of the same name plus `_payments` on the same server. Both are created if they do
//!   not exist, and both get the outbox migrations and their own tables.
//! - `KAFKA_BROKERS`: a Kafka to use; by default an embedded one (librdkafka's mock cluster,
//!   inside this process, gone when it exits).
//! - `NATS_URL`: with `--transport nats`, the `nats-server` (with JetStream: `-js`) to use,
//!   default `nats://127.0.0.1:4222`. The relays and consumers create the streams they need
//!   (`JetStream::create_streams`); a retry is the server's redelivery, so there is no retry
//!   subject. The application's code is the same on either broker: only the builders' broker
//!   setting differs.
//! - `RABBITMQ_URL`: with `--transport rabbitmq`, the server, default
//!   `amqp://guest:guest@127.0.0.1:5672`. The consumers declare their exchanges and queues when
//!   they start (a retry waits in a delay queue).
//!
//! Ctrl-C shuts down gracefully: the HTTP server finishes the requests in flight, then the
//! relays and consumers finish their batch in hand and stop.
//!
//! This file is the lesson: the events, the two services and their wiring; `mariadb.rs` is the
//! two services' database code on MariaDB (`--database mariadb`). `support/` holds
//! what it does not teach: the command line, the databases, where Kafka comes from, the span
//! printer, the `--demo` client, HTTP plumbing, the provider's stand-in, and stopping.

mod mariadb;
mod support;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use outbox_runtime::inbox::{Consumer, HandlerError, MessageMeta, Mode};
use outbox_runtime::relay::Relay;
use outbox_runtime::{inbox_handler, trace, OutboxEvent, Uow};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use support::db::{Databases, OrdersDb};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use uuid::Uuid;

use support::args::{Args, USAGE};
use support::broker::Broker;
use support::http::{print_try_it, ApiError, Server};
use support::latency::Handler;
use support::provider::PaymentProvider;
use support::shutdown::{shutdown_on_ctrl_c, Worker};
use support::{Report, Result};

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

fn orders_api(orders_db: OrdersDb) -> Router {
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
    State(db): State<OrdersDb>,
    headers: HeaderMap,
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
    db: OrdersDb,
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
    let order_id = match &db {
        OrdersDb::Postgres(db) => place_order(db, order).await?,
        OrdersDb::MariaDb(db) => mariadb::place_order(db, order).await?,
    };
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
    support::latency::committed(order_id); // for the demo's report
    Ok(order_id)
}

/// `GET /orders/{id}`: the order and its payment status.
async fn get_order(
    State(db): State<OrdersDb>,
    Path(id): Path<String>,
) -> Result<Json<OrderView>, ApiError> {
    let order_id = Uuid::parse_str(&id).map_err(|_| {
        let message = format!("`{id}` is not an order id (a UUID)");
        ApiError::new(StatusCode::BAD_REQUEST, message)
    })?;
    let row: Option<(String, String, i64, String)> =
        match &db {
            OrdersDb::Postgres(db) => sqlx::query_as(
                "SELECT customer_id, product_id, amount, payment_status FROM orders WHERE id = $1",
            )
            .bind(order_id)
            .fetch_optional(db)
            .await?,
            OrdersDb::MariaDb(db) => mariadb::find_order(db, order_id).await?,
        };
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
    support::latency::handled(Handler::Orders, event.order_id); // for the demo's report
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

// ---------------------------------------------------------------------------------------------
// The payments service: no API, only a consumer of `OrderCreated`, on its own database.

/// The payments service's application state: what its handlers need besides the event and
/// the transaction. The consumer holds it (`.state(...)`) and lends it to every call.
struct Payments {
    /// A payment provider's client, with idempotency keys; like a real one it sometimes times
    /// out after charging (the stand-in in `support/provider.rs`: every tenth new charge).
    provider: PaymentProvider,
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
    support::latency::handled(Handler::Payments, event.order_id); // for the demo's report
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
// Wiring: databases, the broker, background workers, the server, and the shutdown.

#[tokio::main]
async fn main() -> Result<(), Report> {
    let Some(args) = Args::parse(std::env::args().skip(1)).map_err(Report::usage)? else {
        println!("{USAGE}");
        return Ok(());
    };
    // The relay's and consumers' warnings (a broker down, a retried handler) on stderr;
    // RUST_LOG=info (or debug) shows more. Spans also go to OpenTelemetry (printed with
    // `--trace`; a real service exports them, with opentelemetry-otlp say).
    support::trace::init(args.trace);
    run(args).await.map_err(Report)
}

async fn run(args: Args) -> Result<()> {
    // Both databases, created if need be, with the outbox migrations and their tables.
    let databases = Databases::open(args.database).await?;

    // The broker: Kafka, with the topics, the payments consumer's retry topic and the
    // dead-letter topics; or NATS JetStream (`--transport nats`), whose streams are created as
    // needed. `broker.relay(...)` and `broker.consumer(...)` set `.brokers(...)` or
    // `.jetstream(...)`: nothing else depends on the broker.
    // (On MariaDB the orders consumer runs in dedup mode too, with a retry topic of its own.)
    let mut topics = vec![
        OrderCreated::TOPIC,
        "order.events.retry",
        "order.events.dlq",
        PaymentSucceeded::TOPIC,
        "payment.events.dlq",
    ];
    if matches!(databases, Databases::MariaDb { .. }) {
        topics.push("payment.events.retry");
    }
    let broker = Broker::start(args.transport, &topics).await?;

    // Background workers: one relay per outbox, one consumer per service. A relay takes
    // either database's pool; a consumer's handlers take its database's connection.
    let (orders_outbox, payments_outbox) = databases.outboxes();
    let orders_relay = broker.relay(Relay::builder(orders_outbox)).build()?;
    let payments_relay = broker.relay(Relay::builder(payments_outbox)).build()?;
    let payments = Payments {
        provider: PaymentProvider::default(),
    };
    let (payments_consumer, orders_consumer) = match &databases {
        Databases::Postgres {
            orders: orders_db,
            payments: payments_db,
        } => (
            broker
                .consumer(Consumer::builder(payments_db.clone()))
                .group_id("quickstart-payments")
                .state(payments)
                .handler(charge_order) // Mode::Dedup, the default
                .build()?,
            broker
                .consumer(Consumer::builder(orders_db.clone()))
                .group_id("quickstart-orders")
                .handler(mark_order_paid)
                .mode(Mode::Inbox)
                .processors(2)
                .build()?,
        ),
        // The same on MariaDB, both in dedup mode (inbox mode is not built there yet).
        Databases::MariaDb {
            orders: orders_db,
            payments: payments_db,
        } => (
            broker
                .consumer(Consumer::builder(payments_db.clone()))
                .group_id("quickstart-payments")
                .state(payments)
                .handler(mariadb::charge_order)
                .build()?,
            broker
                .consumer(Consumer::builder(orders_db.clone()))
                .group_id("quickstart-orders")
                .handler(mariadb::mark_order_paid)
                .build()?,
        ),
    };

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

    // The HTTP server, until `shutdown`.
    let server = Server::start(args.listen, orders_api(databases.orders()), &shutdown).await?;
    let addr = server.addr();
    println!("orders API listening on http://{addr}");
    // The operator console of both databases, beside the API, if asked for.
    let console = match (args.console, &databases) {
        (Some(listen), Databases::Postgres { orders, payments }) => {
            let app = support::console::router(orders, payments)?;
            let console = Server::start(listen, app, &shutdown).await?;
            let at = console.addr();
            println!("outbox console on http://{at}/orders and http://{at}/payments");
            Some(console)
        }
        // `--console` with `--database mariadb` is refused with the arguments.
        _ => None,
    };

    // Serve until Ctrl-C, or run the demo and stop.
    let mut problems = Vec::new();
    match args.demo {
        None => {
            print_try_it(addr);
            shutdown.cancelled().await;
        }
        Some(n) => {
            tokio::select! {
                result = support::demo::run(addr, databases.orders(), n) => {
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
    if let Err(e) = server.stop().await {
        problems.push(e);
    }
    if let Some(console) = console {
        if let Err(e) = console.stop().await {
            problems.push(e);
        }
    }
    stop.cancel();
    for worker in workers {
        if let Err(e) = worker.stop().await {
            problems.push(e);
        }
    }
    drop(broker); // the embedded mock cluster, if any, goes last
    if problems.is_empty() {
        println!("stopped");
        Ok(())
    } else {
        Err(problems.join("; ").into())
    }
}
