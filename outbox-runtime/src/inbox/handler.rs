//! Handlers, their errors, and the routing table from (topic, event type) to handlers.

#[cfg(feature = "kafka")]
use std::any::{Any, TypeId};
use std::borrow::Cow;
#[cfg(feature = "kafka")]
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
#[cfg(feature = "kafka")]
use std::sync::Arc;

use serde::de::DeserializeOwned;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::event::OutboxEvent;
use crate::sqlstate::DbError;

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

/// A consumer-side event handler. Write an `async fn` and put `#[inbox_handler]` on it; the
/// attribute implements this trait on a unit struct of the function's name.
///
/// `S` is the consumer's application state ([`ConsumerBuilder::state`]): a handler that
/// takes no state implements `Handler<S>` for every `S`; one that takes `state: &Payments`
/// implements only `Handler<Payments>`, so registering it on a consumer of another state is a
/// compile error.
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
/// # fn build(pool: sqlx::PgPool) -> outbox_runtime::Result<()> {
/// # #[cfg(feature = "kafka")]
/// let consumer = outbox_runtime::inbox::Consumer::builder(pool)
///     .brokers("localhost:9092")
///     .group_id("accounting")
///     .state(Rates { eur_per_usd: 0.92 })
///     .handler(Book { ledger: "sales" })
///     .handler(Book { ledger: "tax" })
///     .build()?;
/// # Ok(())
/// # }
/// ```
///
/// [`ConsumerBuilder::state`]: crate::inbox::ConsumerBuilder::state
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an inbox handler for state `{S}`",
    label = "not a handler of a consumer whose state is `{S}`",
    note = "put `#[outbox_runtime::inbox_handler]` on an \
            `async fn(event: E, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError>`; \
            a handler that takes `state: &T` needs a consumer built with `.state(T)` \
            before `.handler(...)`"
)]
pub trait Handler<S = ()>: Send + Sync + 'static {
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
        conn: &'a mut PgConnection,
        state: &'a S,
        meta: &'a MessageMeta<'a>,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
}

#[cfg(feature = "kafka")]
/// Why a message could not be handled.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    /// Try again later.
    Retryable(String),
    /// Dead-letter it.
    Permanent(String),
    /// A statement failed because of the transaction rather than the message: it was already
    /// aborted (by this handler, or, in a transaction shared with other messages, by an
    /// earlier one), or it lost a deadlock or a serialization conflict (SQLSTATE class 40).
    /// Retryable; in a shared transaction, tried again in isolation before it counts.
    Transaction(String),
    /// The handler panicked. Retryable.
    Panicked(String),
}

#[cfg(feature = "kafka")]
impl Failure {
    pub(crate) fn message(&self) -> &str {
        match self {
            Failure::Retryable(m)
            | Failure::Permanent(m)
            | Failure::Transaction(m)
            | Failure::Panicked(m) => m,
        }
    }

    pub(crate) fn is_permanent(&self) -> bool {
        matches!(self, Failure::Permanent(_))
    }

    /// The handler returned `Ok` but left the transaction aborted.
    pub(crate) fn left_aborted(handler: &str) -> Failure {
        Failure::Retryable(format!(
            "handler `{handler}` returned Ok but left its transaction aborted: a statement in it \
             failed and the error was not propagated (caught and ignored?); run a statement \
             whose failure the handler handles in a savepoint (`tx.begin()`), or avoid the \
             error (`ON CONFLICT`)"
        ))
    }
}

#[cfg(feature = "kafka")]
/// A handler with its event type erased: takes the JSON payload.
/// A handler with its event type erased (it takes the JSON payload) and its state bound.
pub(crate) trait ErasedHandler: Send + Sync {
    /// Its name, as in error messages.
    fn name(&self) -> &str;
    /// Its deduplication key in `consumer group`.
    fn dedup_key(&self, group: &str) -> String;
    /// The Rust type of its event (upcasters are registered by it).
    fn event_type_id(&self) -> TypeId;
    /// Whether it takes payloads of `version` as they are (else an upcaster makes its event).
    fn accepts_version(&self, version: u32) -> bool;
    fn handle_json<'a>(
        &'a self,
        payload: &'a [u8],
        conn: &'a mut PgConnection,
        meta: &'a MessageMeta<'a>,
        upcasters: &'a Upcasters,
    ) -> BoxFuture<'a, Result<(), Failure>>;
}

#[cfg(feature = "kafka")]
/// An upcaster to `E`: the JSON payload of an older version in, the event out.
pub(crate) type UpcastFn<E> =
    dyn Fn(serde_json::Value) -> Result<E, BoxError> + Send + Sync + 'static;

#[cfg(feature = "kafka")]
/// Upcasters by event type and the version they read.
#[derive(Default)]
pub(crate) struct Upcasters {
    /// Each value is a `Box<UpcastFn<E>>` for the `E` of its key's `TypeId`.
    by_event: HashMap<(TypeId, u32), Box<dyn Any + Send + Sync>>,
    /// The event types they make, by name, for errors.
    names: Vec<(TypeId, &'static str, u32)>,
}

#[cfg(feature = "kafka")]
impl Upcasters {
    /// Registers `f` to make an `E` from a payload of version `from`.
    pub(crate) fn add<E: OutboxEvent + 'static>(
        &mut self,
        from: u32,
        f: Box<UpcastFn<E>>,
    ) -> Result<(), String> {
        let name = std::any::type_name::<E>();
        if from == 0 {
            return Err(format!(
                "an upcaster to `{name}` from version 0: versions start at 1"
            ));
        }
        if from == E::SCHEMA_VERSION {
            return Err(format!(
                "an upcaster to `{name}` from version {from}, its own version: a payload of \
                 that version is deserialized as it is"
            ));
        }
        let key = (TypeId::of::<E>(), from);
        if self.by_event.contains_key(&key) {
            return Err(format!("two upcasters to `{name}` from version {from}"));
        }
        self.by_event.insert(key, Box::new(f));
        self.names.push((key.0, name, from));
        Ok(())
    }

    /// The upcaster to `E` from `version`, if one is registered.
    fn get<E: 'static>(&self, version: u32) -> Option<&UpcastFn<E>> {
        self.by_event
            .get(&(TypeId::of::<E>(), version))
            // The key's `TypeId` is `E`'s: the downcast cannot fail.
            .and_then(|f| f.downcast_ref::<Box<UpcastFn<E>>>())
            .map(|f| &**f)
    }

    /// An upcaster no handler would ever call, as an error: no handler takes its event, or
    /// every handler of its event takes its version as it is.
    pub(crate) fn unused(&self, handlers: &[&dyn ErasedHandler]) -> Option<String> {
        self.names.iter().find_map(|&(event, name, from)| {
            let mut of_event = handlers.iter().filter(|h| h.event_type_id() == event);
            let Some(first) = of_event.next() else {
                return Some(format!(
                    "an upcaster to `{name}` (from version {from}) is registered, but no \
                     handler takes `{name}`"
                ));
            };
            (first.accepts_version(from) && of_event.all(|h| h.accepts_version(from))).then(|| {
                format!(
                    "an upcaster to `{name}` from version {from} would never run: every \
                     handler of `{name}` takes version {from} itself (its `versions`)"
                )
            })
        })
    }
}

#[cfg(feature = "kafka")]
/// A handler and the state it is called with.
struct Erased<H, S> {
    handler: H,
    state: Arc<S>,
}

#[cfg(feature = "kafka")]
/// The text of a panic's payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with no message".to_owned())
}

#[cfg(feature = "kafka")]
impl<S: Send + Sync + 'static, H: Handler<S>> ErasedHandler for Erased<H, S> {
    fn name(&self) -> &str {
        self.handler.name()
    }

    fn dedup_key(&self, group: &str) -> String {
        self.handler.dedup_key(group)
    }

    fn event_type_id(&self) -> TypeId {
        TypeId::of::<H::Event>()
    }

    fn accepts_version(&self, version: u32) -> bool {
        self.handler.accepts_version(version)
    }

    fn handle_json<'a>(
        &'a self,
        payload: &'a [u8],
        conn: &'a mut PgConnection,
        meta: &'a MessageMeta<'a>,
        upcasters: &'a Upcasters,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        use std::panic::{catch_unwind, AssertUnwindSafe};
        use std::task::Poll;
        Box::pin(async move {
            // A panic (in the event's `Deserialize`, the call or while polling) is the
            // handler's failure, not the consumer's end.
            let panicked = |p: Box<dyn std::any::Any + Send>| {
                Failure::Panicked(format!(
                    "handler `{}` panicked: {}",
                    self.handler.name(),
                    panic_message(p.as_ref())
                ))
            };
            let event: H::Event =
                catch_unwind(AssertUnwindSafe(|| self.event(payload, meta, upcasters)))
                    .map_err(panicked)??;
            let mut future = catch_unwind(AssertUnwindSafe(|| {
                self.handler.handle(event, conn, &self.state, meta)
            }))
            .map_err(panicked)?;
            let result = std::future::poll_fn(|cx| {
                match catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
                    Ok(Poll::Pending) => Poll::Pending,
                    Ok(Poll::Ready(result)) => Poll::Ready(Ok(result)),
                    Err(p) => Poll::Ready(Err(p)),
                }
            })
            .await
            .map_err(panicked)?;
            let name = self.handler.name();
            result.map_err(|error| {
                let transaction_failure =
                    DbError::find(error.inner()).is_some_and(DbError::is_transaction_failure);
                let e = crate::error_chain(error.inner());
                match error {
                    // Whatever the handler called it: the transaction's failure, judged again
                    // alone.
                    _ if transaction_failure => {
                        let e = e.to_string();
                        let hint = if e.contains("transaction is aborted") {
                            " (a statement before it failed and the error was caught: run a \
                             statement whose failure the handler handles in a savepoint \
                             (`tx.begin()`), or avoid the error (`ON CONFLICT`))"
                        } else {
                            ""
                        };
                        Failure::Transaction(format!("handler `{name}` failed: {e}{hint}"))
                    }
                    HandlerError::Retryable(_) => {
                        Failure::Retryable(format!("handler `{name}` failed: {e}"))
                    }
                    HandlerError::Permanent(_) => {
                        Failure::Permanent(format!("handler `{name}` failed for good: {e}"))
                    }
                }
            })
        })
    }
}

#[cfg(feature = "kafka")]
impl<S: Send + Sync + 'static, H: Handler<S>> Erased<H, S> {
    /// The handler's event: the payload as it is if the handler takes its schema version,
    /// else what the upcaster from that version makes of it. Neither is a permanent failure.
    fn event(
        &self,
        payload: &[u8],
        meta: &MessageMeta<'_>,
        upcasters: &Upcasters,
    ) -> Result<H::Event, Failure> {
        let version = meta.schema_version;
        let name = self.handler.name();
        let type_name = std::any::type_name::<H::Event>();
        if self.handler.accepts_version(version) {
            return serde_json::from_slice(payload).map_err(|e| {
                Failure::Permanent(format!(
                    "payload does not deserialize into `{type_name}` (handler `{name}`): {e}"
                ))
            });
        }
        let Some(upcast) = upcasters.get::<H::Event>(version) else {
            return Err(Failure::Permanent(format!(
                "schema version {version} of `{}` is not accepted by handler `{name}` (its \
                 event `{type_name}` is version {}): no upcaster from version {version} is \
                 registered",
                meta.event_type,
                <H::Event as OutboxEvent>::SCHEMA_VERSION,
            )));
        };
        let upcast_failed = |e: &dyn std::fmt::Display| {
            Failure::Permanent(format!(
                "upcasting version {version} of `{}` to `{type_name}` failed (handler \
                 `{name}`): {e}",
                meta.event_type
            ))
        };
        let json: serde_json::Value =
            serde_json::from_slice(payload).map_err(|e| upcast_failed(&e))?;
        upcast(json).map_err(|e| upcast_failed(&crate::error_chain(e.as_ref())))
    }
}

#[cfg(feature = "kafka")]
/// A registered handler, its deduplication key, and the consumer's upcasters.
#[derive(Clone)]
pub(crate) struct Route {
    pub(crate) handler: Arc<dyn ErasedHandler>,
    /// `processed_event.handler` of its rows (set by [`Routes::bind_group`]).
    pub(crate) key: String,
    upcasters: Arc<Upcasters>,
}

#[cfg(feature = "kafka")]
impl Route {
    /// Runs the handler on a message in the transaction `conn` is in.
    pub(crate) fn handle<'a>(
        &'a self,
        payload: &'a [u8],
        conn: &'a mut PgConnection,
        meta: &'a MessageMeta<'a>,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        self.handler
            .handle_json(payload, conn, meta, &self.upcasters)
    }
}

#[cfg(feature = "kafka")]
/// Handlers by (topic, event type).
#[derive(Default, Clone)]
pub(crate) struct Routes {
    routes: HashMap<(String, String), Vec<Route>>,
}

#[cfg(feature = "kafka")]
impl Routes {
    /// Registers `handler`, to be called with `state`.
    pub(crate) fn add<S: Send + Sync + 'static, H: Handler<S>>(
        &mut self,
        handler: H,
        state: Arc<S>,
    ) -> Result<(), String> {
        let key = (
            <H::Event as OutboxEvent>::TOPIC.to_owned(),
            <H::Event as OutboxEvent>::EVENT_TYPE.to_owned(),
        );
        let event_type = <H::Event as OutboxEvent>::EVENT_TYPE;
        let list = self.routes.entry(key).or_default();
        if handler.name().is_empty() {
            return Err(format!(
                "a handler of `{}` has an empty name",
                std::any::type_name::<H>()
            ));
        }
        if list.iter().any(|r| r.handler.name() == handler.name()) {
            return Err(format!(
                "handler `{}` is registered twice for event `{}` (two instances of one handler \
                 type need different names)",
                handler.name(),
                event_type
            ));
        }
        list.push(Route {
            handler: Arc::new(Erased { handler, state }),
            key: String::new(),
            upcasters: Arc::default(),
        });
        Ok(())
    }

    /// Gives every handler the consumer's upcasters; refuses one no handler can use.
    pub(crate) fn bind_upcasters(&mut self, upcasters: Upcasters) -> Result<(), String> {
        let handlers: Vec<&dyn ErasedHandler> = self
            .routes
            .values()
            .flatten()
            .map(|r| &*r.handler)
            .collect();
        if let Some(e) = upcasters.unused(&handlers) {
            return Err(e);
        }
        let upcasters = Arc::new(upcasters);
        for route in self.routes.values_mut().flatten() {
            route.upcasters = Arc::clone(&upcasters);
        }
        Ok(())
    }

    /// Sets every handler's deduplication key for consumer group `group`; refuses two
    /// handlers of one event with the same key.
    pub(crate) fn bind_group(&mut self, group: &str) -> Result<(), String> {
        for list in self.routes.values_mut() {
            for route in list.iter_mut() {
                route.key = route.handler.dedup_key(group);
            }
            let mut keys: Vec<&str> = list.iter().map(|r| r.key.as_str()).collect();
            keys.sort_unstable();
            if let Some(w) = keys.windows(2).find(|w| w[0] == w[1]) {
                return Err(format!(
                    "two handlers of one event share the deduplication key `{}`",
                    w[0]
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn get(&self, topic: &str, event_type: &str) -> &[Route] {
        self.routes
            .get(&(topic.to_owned(), event_type.to_owned()))
            .map_or(&[], Vec::as_slice)
    }

    pub(crate) fn topics(&self) -> Vec<String> {
        let mut topics: Vec<String> = self.routes.keys().map(|(t, _)| t.clone()).collect();
        topics.sort();
        topics.dedup();
        topics
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }
}
