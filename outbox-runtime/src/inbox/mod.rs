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
//! **Dedup** (default): messages are handled in batches, in one transaction: for each message
//! and handler, `(event_id, "<group>/<handler>")` is inserted into `processed_event`
//! (`ON CONFLICT DO NOTHING`); only if the row is new does the handler run, in the same
//! transaction; then it commits; only then are the offsets stored
//! (`enable.auto.offset.store=false`) and later committed. A duplicate is skipped. The
//! handler's effect happens exactly once per event id. If a handler fails, the work since the
//! last savepoint is undone and done again: what came before the failing message, that
//! message alone (a savepoint per handler), then the rest; so only the failing message fails,
//! and the batch still commits once.
//!
//! **Inbox**: the consumer only stores each message in `inbox_event`
//! (`ON CONFLICT (event_id) DO NOTHING`, batched), commits, then stores the offsets, so receipt
//! keeps up with a burst. Processor tasks (`processors`, default 1; more in other processes)
//! claim unprocessed rows `FOR UPDATE SKIP LOCKED` in batches and run each row's handlers and
//! `processed = true` in one transaction (again with a savepoint per row if one fails). Failures
//! record `attempts`, `last_error` and `next_attempt_at` on the row; after `max_attempts` (or a
//! permanent failure) the row is dead (`dead_at`), kept for operators. Inbox processing does
//! not keep per-key order. A processor that stops on its own is restarted.
//!
//! # Retries ([`RetryPolicy`], dedup mode)
//!
//! [`RetryPolicy::Topic`] (default, the style guide's R-DIST-OBX-2): a message whose handler
//! failed retryably is sent to `<topic>.retry` with its key, value and headers, plus its
//! attempts, when it is due, its source topic and the error, and its offset is stored: its
//! partition flows on. The consumer reads the retry topic too and handles each message once
//! due; after `max_attempts`, `<topic>.dlq`. A retried message is thus handled after its key's
//! later messages. [`RetryPolicy::InPlace`] keeps per-key order instead: the consumer retries
//! the message before anything after it, and every partition it reads waits meanwhile.
//!
//! A retry or dead-letter topic that is missing stops consumption until it takes the message:
//! logged as an error with the topic's name, reported by the gauge
//! `outbox_consumer_forward_blocked{topic}`; the consumer keeps polling with its partitions
//! paused, so it stays in its group. Retries and dead letters are sent at least once: a
//! rebalance before the offset's commit sends one again.
//!
//! # What handlers must know
//!
//! - **A handler that catches a database error must use a savepoint or `ON CONFLICT`; if it
//!   does not, the framework treats the message as failed.** A failed statement aborts the
//!   transaction, and PostgreSQL answers `COMMIT` of an aborted transaction with a silent
//!   rollback. The framework checks the transaction after each handler (releasing its
//!   savepoint) and at commit; a handler that left it aborted fails its message only, with an
//!   error that says so. Use `let mut sp = tx.begin().await?` around a statement whose failure
//!   you handle, or avoid the error (`ON CONFLICT DO NOTHING`).
//! - Work refused at commit (a deferred constraint) fails its message: for good if it is an
//!   integrity violation. A deadlock or serialization failure is retried.
//! - **A panic** (in the handler, its future or its event's `Deserialize`) is caught and is a
//!   failure like any other: retried with the panic's message, then dead-lettered.
//! - A handler can run more than once for one delivery (when a batch-mate fails, the batch is
//!   redone): its database work commits once; whatever it does outside the transaction must
//!   be idempotent.
//! - **Dedup keys** are `<consumer group>/<handler name>`, so services (groups) sharing a
//!   database never skip each other's work; `#[inbox_handler(name = "...")]` makes the key
//!   that name exactly. To rename a handler without handling retained events again:
//!   `UPDATE processed_event SET handler = 'group/new' WHERE handler = 'group/old'` while no
//!   consumer of the group runs.
//!
//! **Bad input**: a message that is not JSON, has no valid `event_id` header, does not
//! deserialize into the handler's event type, or (inbox mode) that `jsonb` refuses goes to the
//! dead-letter topic (`<topic>.dlq` by default) with its key, value and headers and the reason
//! in a `dlq_error` header; its offset is stored and consumption goes on. A message no handler
//! is registered for is skipped.

#[cfg(feature = "kafka")]
pub(crate) mod batch;
#[cfg(feature = "kafka")]
mod builder;
#[cfg(feature = "kafka")]
mod consumer;
#[cfg(feature = "kafka")]
mod dedup;
#[cfg(feature = "kafka")]
pub(crate) mod failure;
#[cfg(feature = "kafka")]
mod forward;
mod handler;
#[cfg(feature = "kafka")]
mod ladder;
#[cfg(feature = "kafka")]
pub(crate) mod message;
mod meta;
#[cfg(feature = "kafka")]
mod poll;
#[cfg(feature = "kafka")]
mod processor;
#[cfg(feature = "kafka")]
mod receive;
#[cfg(feature = "kafka")]
pub(crate) mod route;
#[cfg(feature = "kafka")]
mod settings;
#[cfg(feature = "kafka")]
mod shared;
#[cfg(feature = "kafka")]
mod store;
#[cfg(feature = "kafka")]
mod upcast;

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use builder::ConsumerBuilder;
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use consumer::Consumer;
pub use handler::{BoxError, BoxFuture, Handler, HandlerError};
pub use meta::MessageMeta;
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use settings::{Mode, RetryPolicy};
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use store::{inbox_status, InboxStatus};
