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
/// `?` converts database errors: integrity violations (SQLSTATE class 23) are permanent,
/// everything else (lost connections, serialization failures, deadlocks, ...) retryable.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// May succeed if tried again.
    #[error("{0}")]
    Retryable(#[source] BoxError),
    /// Will fail however often it is tried.
    #[error("{0}")]
    Permanent(#[source] BoxError),
}

impl HandlerError {
    pub fn retryable(error: impl Into<BoxError>) -> Self {
        HandlerError::Retryable(error.into())
    }

    pub fn permanent(error: impl Into<BoxError>) -> Self {
        HandlerError::Permanent(error.into())
    }

    pub fn is_retryable(&self) -> bool {
        matches!(self, HandlerError::Retryable(_))
    }
}

impl From<sqlx::Error> for HandlerError {
    fn from(error: sqlx::Error) -> Self {
        let integrity = matches!(
            &error,
            sqlx::Error::Database(e) if e.code().is_some_and(|c| c.starts_with("23"))
        );
        if integrity {
            HandlerError::Permanent(error.into())
        } else {
            HandlerError::Retryable(error.into())
        }
    }
}

impl From<crate::Error> for HandlerError {
    fn from(error: crate::Error) -> Self {
        match error {
            crate::Error::Database(e) => e.into(),
            other => HandlerError::Permanent(other.into()),
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
    /// The handler's name, the key of its deduplication rows: keep it stable.
    const NAME: &'static str;

    /// Runs the handler in the transaction `conn` is in.
    fn handle<'a>(
        &'a self,
        event: Self::Event,
        conn: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
}

#[cfg(feature = "kafka")]
/// Why a message could not be handled.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Try again later.
    Retryable(String),
    /// Dead-letter it.
    Permanent(String),
}

#[cfg(feature = "kafka")]
impl Failure {
    pub(crate) fn message(&self) -> &str {
        match self {
            Failure::Retryable(m) | Failure::Permanent(m) => m,
        }
    }
}

#[cfg(feature = "kafka")]
/// A handler with its event type erased: takes the JSON payload.
pub(crate) trait ErasedHandler: Send + Sync {
    fn name(&self) -> &'static str;
    fn handle_json<'a>(
        &'a self,
        payload: &'a [u8],
        conn: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<(), Failure>>;
}

#[cfg(feature = "kafka")]
struct Erased<H>(H);

#[cfg(feature = "kafka")]
impl<H: Handler> ErasedHandler for Erased<H> {
    fn name(&self) -> &'static str {
        H::NAME
    }

    fn handle_json<'a>(
        &'a self,
        payload: &'a [u8],
        conn: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            let event: H::Event = serde_json::from_slice(payload).map_err(|e| {
                Failure::Permanent(format!(
                    "payload does not deserialize into `{}` (handler `{}`): {e}",
                    std::any::type_name::<H::Event>(),
                    H::NAME
                ))
            })?;
            self.0.handle(event, conn).await.map_err(|e| match e {
                HandlerError::Retryable(e) => {
                    Failure::Retryable(format!("handler `{}` failed: {e}", H::NAME))
                }
                HandlerError::Permanent(e) => {
                    Failure::Permanent(format!("handler `{}` failed for good: {e}", H::NAME))
                }
            })
        })
    }
}

#[cfg(feature = "kafka")]
/// Handlers by (topic, event type).
#[derive(Default, Clone)]
pub(crate) struct Routes {
    routes: HashMap<(String, String), Vec<Arc<dyn ErasedHandler>>>,
}

#[cfg(feature = "kafka")]
impl Routes {
    pub(crate) fn add<H: Handler>(&mut self, handler: H) -> Result<(), String> {
        let key = (
            <H::Event as OutboxEvent>::TOPIC.to_owned(),
            <H::Event as OutboxEvent>::EVENT_TYPE.to_owned(),
        );
        let list = self.routes.entry(key).or_default();
        if list.iter().any(|h| h.name() == H::NAME) {
            return Err(format!("handler `{}` is registered twice", H::NAME));
        }
        list.push(Arc::new(Erased(handler)));
        Ok(())
    }

    pub(crate) fn get(&self, topic: &str, event_type: &str) -> &[Arc<dyn ErasedHandler>] {
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
