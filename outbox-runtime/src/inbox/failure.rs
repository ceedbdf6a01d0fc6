//! [`Failure`]: why a message could not be handled, as the consumer records and routes it, and
//! where it goes ([`Destination`]).

use super::handler::HandlerError;
use crate::sqlstate::DbError;

/// Where a failed message goes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Destination {
    /// Tried again at `due_ms` (Kafka: through the retry topic; JetStream: redelivered);
    /// `attempts` failed so far.
    Retry { attempts: u32, due_ms: i64 },
    /// The dead letters.
    DeadLetter { attempts: u32 },
}

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

    /// Handler `name`'s error. Whatever the handler called it, a failure of the transaction
    /// (an aborted one, a deadlock, a serialization conflict) is [`Failure::Transaction`]:
    /// judged again alone.
    pub(crate) fn of_handler(name: &str, error: HandlerError) -> Failure {
        let transaction_failure =
            DbError::find(error.inner()).is_some_and(DbError::is_transaction_failure);
        let e = crate::error_chain(error.inner());
        match error {
            _ if transaction_failure => {
                let e = e.to_string();
                let hint = if e.contains("transaction is aborted") {
                    " (a statement before it failed and the error was caught: run a statement \
                     whose failure the handler handles in a savepoint (`tx.begin()`), or avoid \
                     the error (`ON CONFLICT`))"
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
    }

    /// Work refused at commit (a deferred constraint, a serialization failure): the message's,
    /// not the database's. Integrity violations are permanent.
    pub(crate) fn refused_at_commit(error: &sqlx::Error) -> Failure {
        let message = format!("the transaction of its handlers was refused at commit: {error}");
        match DbError::of(error) {
            DbError::Integrity => Failure::Permanent(message),
            _ => Failure::Retryable(message),
        }
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

/// The text of a panic's payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with no message".to_owned())
}
