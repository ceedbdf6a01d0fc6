//! Handlers: the [`Handler`] trait (what `#[inbox_handler]` implements) and how they fail
//! ([`HandlerError`]).

use std::future::Future;
use std::pin::Pin;

use super::meta::MessageMeta;
use crate::event::OutboxEvent;
use crate::sqlstate::DbError;
use serde::de::DeserializeOwned;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A boxed error, as handlers and upcasters return it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// How a handler failed: a retryable failure is tried again (with backoff, up to the
/// consumer's `max_attempts`), a permanent one goes to the dead letters at once.
///
/// `?` converts database errors: integrity violations and data exceptions (SQLSTATE classes
/// 23 and 22) are permanent, everything else (lost connections, serialization failures,
/// deadlocks, timeouts, ...) retryable. It converts this crate's [`Error`](crate::Error) the same way: what
/// [`is_transient`](crate::Error::is_transient) (a timeout or deadlock during an emit, a lost
/// connection) and other database errors are retryable; an event that cannot be emitted
/// (invalid, not serializable, a duplicate event id) is permanent.
///
/// It displays as the error it wraps, and its [`source`](std::error::Error::source) is that
/// error's source: printed through `anyhow`, nothing repeats.
#[derive(Debug)]
pub enum HandlerError {
    /// May succeed if tried again.
    Retryable(BoxError),
    /// Will fail however often it is tried.
    Permanent(BoxError),
}

impl HandlerError {
    /// A failure that may pass if the message is handled again.
    pub fn retryable(error: impl Into<BoxError>) -> Self {
        HandlerError::Retryable(error.into())
    }

    /// A failure that will not pass: the message goes to the dead letters.
    pub fn permanent(error: impl Into<BoxError>) -> Self {
        HandlerError::Permanent(error.into())
    }

    /// Whether the message is tried again.
    pub fn is_retryable(&self) -> bool {
        matches!(self, HandlerError::Retryable(_))
    }

    /// The error it wraps.
    pub fn inner(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        match self {
            HandlerError::Retryable(e) | HandlerError::Permanent(e) => e.as_ref(),
        }
    }
}

impl std::fmt::Display for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self.inner(), f)
    }
}

impl std::error::Error for HandlerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner().source()
    }
}

impl From<sqlx::Error> for HandlerError {
    fn from(error: sqlx::Error) -> Self {
        if DbError::of(&error).is_permanent() {
            HandlerError::Permanent(error.into())
        } else {
            HandlerError::Retryable(error.into())
        }
    }
}

impl From<crate::Error> for HandlerError {
    fn from(error: crate::Error) -> Self {
        use crate::Error;
        let retryable = error.is_transient()
            || match &error {
                Error::Emit { source, .. }
                | Error::Commit { source, .. }
                | Error::Database(source) => !DbError::of(source).is_permanent(),
                _ => false,
            };
        if retryable {
            HandlerError::Retryable(error.into())
        } else {
            HandlerError::Permanent(error.into())
        }
    }
}

/// A consumer-side event handler. Write an `async fn` and put `#[inbox_handler]` on it; the
/// attribute implements this trait on a unit struct of the function's name.
///
/// `S` is the consumer's application state ([`ConsumerBuilder::state`]): a handler that
/// takes no state implements `Handler<S>` for every `S`; one that takes `state: &Payments`
/// implements only `Handler<Payments>`, so registering it on a consumer of another state is a
/// compile error.
///
/// `D` is the database whose transaction it joins: PostgreSQL by default (`&mut PgConnection`),
/// or with the feature `mysql`, `sqlx::MySql` (`&mut MySqlConnection`: MariaDB or MySQL). A
/// consumer built on a `MySqlPool` takes only `Handler<S, MySql>`s, and one on a `PgPool` only
/// PostgreSQL's: a handler of the other database is a compile error.
///
/// Implement it by hand for handlers that carry configuration. Each instance names itself, so
/// two instances of one type, configured differently, are two handlers with their own
/// deduplication rows:
///
/// ```
/// use outbox_runtime::inbox::{BoxFuture, Handler, HandlerError, MessageMeta};
/// use sqlx::PgConnection;
/// # #[derive(serde::Serialize, serde::Deserialize, outbox_runtime::OutboxEvent)]
/// # #[outbox(topic = "order.events", aggregate_type = "Order")]
/// # struct OrderCreated { #[outbox(aggregate_id)] order_id: uuid::Uuid, amount: i64 }
///
/// /// Application state: the consumer holds one, every handler borrows it.
/// struct Rates {
///     eur_per_usd: f64,
/// }
///
/// /// Books an order into one ledger; one instance per ledger.
/// struct Book {
///     ledger: &'static str,
/// }
///
/// impl Handler<Rates> for Book {
///     type Event = OrderCreated;
///
///     fn name(&self) -> &str {
///         self.ledger
///     }
///
///     fn handle<'a>(
///         &'a self,
///         event: OrderCreated,
///         tx: &'a mut PgConnection,
///         rates: &'a Rates,
///         meta: &'a MessageMeta<'a>,
///     ) -> BoxFuture<'a, Result<(), HandlerError>> {
///         Box::pin(async move {
///             let amount = event.amount as f64 * rates.eur_per_usd;
///             sqlx::query("INSERT INTO ledger (ledger, order_id, amount, attempt) VALUES ($1, $2, $3, $4)")
///                 .bind(self.ledger)
///                 .bind(event.order_id)
///                 .bind(amount)
///                 .bind(meta.attempt() as i32)
///                 .execute(tx)
///                 .await?;
///             Ok(())
///         })
///     }
/// }
///
/// # fn build(pool: sqlx::PgPool) {
/// let consumer = outbox_runtime::inbox::Consumer::builder(pool)
///     .group_id("accounting")
///     .state(Rates { eur_per_usd: 0.92 })
///     .handler(Book { ledger: "sales" })
///     .handler(Book { ledger: "tax" });
/// // ... then its broker (`brokers(...)` or `jetstream(...)`) and `build()`.
/// # let _ = consumer;
/// # }
/// ```
///
/// [`ConsumerBuilder::state`]: crate::inbox::ConsumerBuilder::state
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an inbox handler for state `{S}` on database `{D}`",
    label = "not a handler of a consumer whose state is `{S}` and whose database is `{D}`",
    note = "put `#[outbox_runtime::inbox_handler]` on an \
            `async fn(event: E, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError>` \
            (`&mut sqlx::MySqlConnection` for a consumer on a `MySqlPool`); \
            a handler that takes `state: &T` needs a consumer built with `.state(T)` \
            before `.handler(...)`"
)]
pub trait Handler<S = (), D: sqlx::Database = sqlx::Postgres>: Send + Sync + 'static {
    /// The event it handles; routed by its topic and event type.
    type Event: OutboxEvent + DeserializeOwned + Send + 'static;

    /// The handler's name, in logs and errors, and in its deduplication key
    /// ([`dedup_key`](Self::dedup_key)). Handlers of one event on one consumer must have
    /// different names.
    fn name(&self) -> &str;

    /// `processed_event.handler` of its rows in consumer group `group`: by default
    /// `<group>/<name>`, so that services (consumer groups) sharing a database never skip each
    /// other's work. `#[inbox_handler(name = "...")]` makes it the name as it stands.
    fn dedup_key(&self, group: &str) -> String {
        format!("{group}/{}", self.name())
    }

    /// Whether it takes an event sent with schema `version` as it is, deserialized straight
    /// into [`Event`](Self::Event): by default only the event's own version
    /// ([`OutboxEvent::SCHEMA_VERSION`]). `#[inbox_handler(versions = [1, 2])]` lists the
    /// versions its struct reads (with serde defaults for new fields, say).
    ///
    /// A message of a version it does not take is upcast if an upcaster from that version is
    /// registered ([`ConsumerBuilder::upcast`](crate::inbox::ConsumerBuilder::upcast)), and
    /// otherwise fails for good: it goes to the dead letters, with the versions in the reason.
    fn accepts_version(&self, version: u32) -> bool {
        version == <Self::Event as OutboxEvent>::SCHEMA_VERSION
    }

    /// Runs the handler in the transaction `conn` is in, with the consumer's `state` and the
    /// message's metadata.
    fn handle<'a>(
        &'a self,
        event: Self::Event,
        conn: &'a mut D::Connection,
        state: &'a S,
        meta: &'a MessageMeta<'a>,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
}
