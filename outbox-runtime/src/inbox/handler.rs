//! Handlers, their errors, and the routing table from (topic, event type) to handlers.

#[cfg(feature = "kafka")]
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
#[cfg(feature = "kafka")]
use std::sync::Arc;

use serde::de::DeserializeOwned;
use sqlx::PgConnection;

use crate::event::OutboxEvent;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

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

/// Database errors that will fail again: integrity violations (SQLSTATE class 23) and data
/// exceptions (class 22: a value out of range, text jsonb refuses, ...).
fn fails_again(error: &sqlx::Error) -> bool {
    matches!(
        error,
        sqlx::Error::Database(e)
            if e.code().is_some_and(|c| c.starts_with("23") || c.starts_with("22"))
    )
}

impl From<sqlx::Error> for HandlerError {
    fn from(error: sqlx::Error) -> Self {
        if fails_again(&error) {
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
                | Error::Database(source) => !fails_again(source),
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
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an inbox handler",
    note = "put `#[outbox_runtime::inbox_handler]` on an \
            `async fn(event: E, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError>`"
)]
pub trait Handler: Send + Sync + 'static {
    /// The event it handles; routed by its topic and event type.
    type Event: OutboxEvent + DeserializeOwned + Send + 'static;
    /// The handler's name. Its deduplication rows are keyed by `<consumer group>/<NAME>`, so
    /// that services (consumer groups) sharing a database never skip each other's work.
    const NAME: &'static str;
    /// Whether [`NAME`](Self::NAME) was chosen explicitly (`#[inbox_handler(name = "...")]`):
    /// then it is the deduplication key as it stands, whatever the consumer group.
    const EXPLICIT_NAME: bool = false;

    /// Runs the handler in the transaction `conn` is in.
    fn handle<'a>(
        &'a self,
        event: Self::Event,
        conn: &'a mut PgConnection,
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
pub(crate) trait ErasedHandler: Send + Sync {
    /// Its name, as in error messages.
    fn name(&self) -> &'static str;
    /// Its deduplication key in `consumer group`.
    fn dedup_key(&self, group: &str) -> String;
    fn handle_json<'a>(
        &'a self,
        payload: &'a [u8],
        conn: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<(), Failure>>;
}

#[cfg(feature = "kafka")]
struct Erased<H>(H);

#[cfg(feature = "kafka")]
/// A database error of the transaction rather than of the message: in an aborted transaction
/// (25P02), a deadlock or serialization failure (class 40).
fn is_transaction_failure(error: &(dyn std::error::Error + 'static)) -> bool {
    // The database error may be wrapped (by this crate's `Error`, or the application's own).
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(sqlx::Error::Database(db)) = e.downcast_ref::<sqlx::Error>() {
            return db
                .code()
                .is_some_and(|c| c == "25P02" || c.starts_with("40"));
        }
        next = e.source();
    }
    false
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
impl<H: Handler> ErasedHandler for Erased<H> {
    fn name(&self) -> &'static str {
        H::NAME
    }

    fn dedup_key(&self, group: &str) -> String {
        if H::EXPLICIT_NAME {
            H::NAME.to_owned()
        } else {
            format!("{group}/{}", H::NAME)
        }
    }

    fn handle_json<'a>(
        &'a self,
        payload: &'a [u8],
        conn: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        use std::panic::{catch_unwind, AssertUnwindSafe};
        use std::task::Poll;
        Box::pin(async move {
            // A panic (in the event's `Deserialize`, the call or while polling) is the
            // handler's failure, not the consumer's end.
            let panicked = |p: Box<dyn std::any::Any + Send>| {
                Failure::Panicked(format!(
                    "handler `{}` panicked: {}",
                    H::NAME,
                    panic_message(p.as_ref())
                ))
            };
            let event: H::Event = catch_unwind(|| serde_json::from_slice(payload))
                .map_err(panicked)?
                .map_err(|e| {
                    Failure::Permanent(format!(
                        "payload does not deserialize into `{}` (handler `{}`): {e}",
                        std::any::type_name::<H::Event>(),
                        H::NAME
                    ))
                })?;
            let mut future =
                catch_unwind(AssertUnwindSafe(|| self.0.handle(event, conn))).map_err(panicked)?;
            let result = std::future::poll_fn(|cx| {
                match catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
                    Ok(Poll::Pending) => Poll::Pending,
                    Ok(Poll::Ready(result)) => Poll::Ready(Ok(result)),
                    Err(p) => Poll::Ready(Err(p)),
                }
            })
            .await
            .map_err(panicked)?;
            result.map_err(|error| {
                let transaction_failure = is_transaction_failure(error.inner());
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
                        Failure::Transaction(format!("handler `{}` failed: {e}{hint}", H::NAME))
                    }
                    HandlerError::Retryable(_) => {
                        Failure::Retryable(format!("handler `{}` failed: {e}", H::NAME))
                    }
                    HandlerError::Permanent(_) => {
                        Failure::Permanent(format!("handler `{}` failed for good: {e}", H::NAME))
                    }
                }
            })
        })
    }
}

#[cfg(feature = "kafka")]
/// A registered handler and its deduplication key.
#[derive(Clone)]
pub(crate) struct Route {
    pub(crate) handler: Arc<dyn ErasedHandler>,
    /// `processed_event.handler` of its rows (set by [`Routes::bind_group`]).
    pub(crate) key: String,
}

#[cfg(feature = "kafka")]
/// Handlers by (topic, event type).
#[derive(Default, Clone)]
pub(crate) struct Routes {
    routes: HashMap<(String, String), Vec<Route>>,
}

#[cfg(feature = "kafka")]
impl Routes {
    pub(crate) fn add<H: Handler>(&mut self, handler: H) -> Result<(), String> {
        let key = (
            <H::Event as OutboxEvent>::TOPIC.to_owned(),
            <H::Event as OutboxEvent>::EVENT_TYPE.to_owned(),
        );
        let list = self.routes.entry(key).or_default();
        if list.iter().any(|r| r.handler.name() == H::NAME) {
            return Err(format!("handler `{}` is registered twice", H::NAME));
        }
        list.push(Route {
            handler: Arc::new(Erased(handler)),
            key: String::new(),
        });
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
