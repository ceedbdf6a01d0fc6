//! Committing a transaction so that an aborted one is never taken for a committed one, and a
//! commit whose outcome nobody can know says so.

use std::borrow::Cow;

use sqlx::{Executor, PgConnection, Postgres, Transaction};

use crate::error::{Error, Result};
use crate::sqlstate::DbError;

/// Commits a transaction this crate began (at depth 1), checked as [`Uow::commit`] does: an
/// aborted transaction is [`Error::Aborted`], a refused commit [`Error::Commit`], a session lost
/// on the way [`Error::CommitOutcomeUnknown`].
#[cfg(feature = "_broker")]
pub(crate) async fn commit_checked(tx: Transaction<'_, Postgres>) -> Result<()> {
    commit_after(tx, String::from("SELECT"), Cow::Borrowed("")).await
}

/// Sends `sql` (whose failure in an aborted transaction is the point), `COMMIT`, and `BEGIN` of
/// an empty transaction that the dropped `Transaction` rolls back with the connection's next
/// use (so sqlx's depth and the server agree again without a round trip), as one simple query;
/// judges the outcome by the statements that completed.
pub(super) async fn commit_after(
    mut tx: Transaction<'_, Postgres>,
    mut sql: String,
    event_types: Cow<'static, str>,
) -> Result<()> {
    sql.push_str("; COMMIT; BEGIN");
    match run_counting(&mut tx, &sql).await {
        Ok(_) => Ok(()),
        // COMMIT completed; what failed came after it (the server going away, say).
        Err((completed, _)) if completed >= 2 => Ok(()),
        Err((_, e)) => {
            let error = commit_error(e, event_types);
            if !error.is_outcome_unknown() {
                // Release its locks now, not when the connection is next used.
                if let Err(e) = tx.rollback().await {
                    tracing::debug!(error = %crate::error_chain(&e), "cannot roll back a failed transaction");
                }
            }
            Err(error)
        }
    }
}

/// Runs a simple query of several statements; on an error, also says how many statements had
/// completed before it.
async fn run_counting(
    conn: &mut PgConnection,
    sql: &str,
) -> std::result::Result<u64, (u64, sqlx::Error)> {
    let mut results = conn.fetch_many(sql);
    let mut completed = 0;
    loop {
        match std::future::poll_fn(|cx| results.as_mut().poll_next(cx)).await {
            None => return Ok(completed),
            Some(Ok(sqlx::Either::Left(_))) => completed += 1,
            Some(Ok(sqlx::Either::Right(_))) => {}
            Some(Err(e)) => return Err((completed, e)),
        }
    }
}

/// What a failed commit means: refused (nothing written), aborted earlier, or unknown.
pub(super) fn commit_error(source: sqlx::Error, event_types: Cow<'static, str>) -> Error {
    match &source {
        _ if DbError::of(&source) == DbError::Aborted => Error::Aborted { event_types },
        // A statement failed: the server skipped the rest, COMMIT included.
        sqlx::Error::Database(e) if !is_fatal(e.as_ref()) => Error::Commit {
            event_types,
            source,
        },
        // The session ended (the server shutting down, the connection lost) while COMMIT was
        // on its way: it may have committed before.
        _ => Error::CommitOutcomeUnknown {
            event_types,
            source,
        },
    }
}

/// Whether the server ended the session with this error (FATAL or PANIC), rather than failing
/// one statement.
fn is_fatal(error: &dyn sqlx::error::DatabaseError) -> bool {
    use sqlx::postgres::{PgDatabaseError, PgSeverity};
    error
        .try_downcast_ref::<PgDatabaseError>()
        .is_some_and(|e| matches!(e.severity(), PgSeverity::Fatal | PgSeverity::Panic))
}
