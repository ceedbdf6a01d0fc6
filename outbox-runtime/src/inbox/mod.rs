//! Consumers: deduplicated, transactional event handling with retries and dead letters
//! (rule R-DIST-OBX-2: delivery is at-least-once, so every receiver must be idempotent).
//!
//! ```no_run
//! use outbox_runtime::inbox::{Consumer, HandlerError, Mode};
//! use outbox_runtime::OutboxEvent;
//! use tokio_util::sync::CancellationToken;
//! use uuid::Uuid;
//!
//! #[derive(serde::Deserialize, serde::Serialize, OutboxEvent)]
//! #[outbox(topic = "payment.events", aggregate_type = "Payment", event_type = "PaymentSucceeded")]
//! struct PaymentSucceeded { #[outbox(aggregate_id)] payment_id: Uuid, order_id: Uuid, amount: i64 }
//!
//! #[outbox_runtime::inbox_handler]
//! async fn mark_order_paid(event: PaymentSucceeded, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
//!     sqlx::query("UPDATE orders SET payment_status = 'paid' WHERE id = $1")
//!         .bind(event.order_id).execute(tx).await?;
//!     Ok(())
//! }
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let consumer = Consumer::builder(pool.clone())
//!     .brokers("127.0.0.1:9092")
//!     .group_id("orders-service")
//!     .handler(mark_order_paid)    // several handlers; routed by topic + event_type header
//!     .mode(Mode::Dedup)           // default; Mode::Inbox for critical / bursty flows
//!     .build()?;
//! let cancel = CancellationToken::new();
//! let handle = consumer.spawn(cancel.clone());
//! # cancel.cancel(); handle.await??; Ok(()) }
//! ```
//!
//! # Modes
//!
//! **Dedup** (default): for each message and handler, one transaction inserts
//! `(event_id, handler)` into `processed_event` (`ON CONFLICT DO NOTHING`); only if the row is
//! new does the handler run, in the same transaction; then it commits; only then is the Kafka
//! offset stored (`enable.auto.offset.store=false`) and later committed. A duplicate is skipped.
//! The handler's effect happens exactly once per event id. A retryable failure is retried in
//! process, with backoff, up to `max_attempts` (the partition waits meanwhile), then
//! dead-lettered; a permanent one is dead-lettered at once.
//!
//! **Inbox**: the consumer only stores each message in `inbox_event`
//! (`ON CONFLICT (event_id) DO NOTHING`, batched), commits, then stores the offsets, so receipt
//! keeps up with a burst. Processor tasks (`processors`, default 1; more in other processes)
//! claim unprocessed rows `FOR UPDATE SKIP LOCKED` in batches and run each row's handlers and
//! `processed = true` under a savepoint of the batch's transaction, so a failing row undoes
//! only its own work. Failures record `attempts`, `last_error` and `next_attempt_at` on the row;
//! after `max_attempts` (or a permanent failure) the row is dead (`dead_at`), kept for
//! operators. Inbox processing does not keep per-key order.
//!
//! **Bad input**: a message that is not JSON, has no valid `event_id` header, or does not
//! deserialize into the handler's event type goes to the dead-letter topic (`<topic>.dlq` by
//! default) with its key, value and headers and the reason in a `dlq_error` header; its offset is
//! stored and consumption goes on. A message no handler is registered for is skipped.

#[cfg(feature = "kafka")]
mod consumer;
mod handler;
#[cfg(feature = "kafka")]
mod store;

#[cfg(feature = "kafka")]
pub use consumer::{Consumer, ConsumerBuilder, Mode};
pub use handler::{BoxFuture, Handler, HandlerError};
#[cfg(feature = "kafka")]
pub use store::{inbox_status, InboxStatus};
