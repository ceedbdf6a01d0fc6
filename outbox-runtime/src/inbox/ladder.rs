//! The fallback ladder both consumer modes climb down to handle a batch so that one item's
//! failure fails that item only: every item in one transaction; after a handler's failure (or
//! a transaction left aborted), one transaction with a savepoint per item, the failures seen
//! not run again; after a refused commit (a deferred constraint), one transaction per item, so
//! that the refusal falls on its item. Dedup mode's batches ([`batch`](super::batch)) and the
//! inbox processors' ([`processor`](super::processor)) are its two kinds of [`Batch`]; both
//! end an item's savepoint with [`settle`], where a handler that left it aborted is caught.

use std::collections::HashMap;
use std::hash::Hash;

use super::failure::Failure;
use crate::error::Result;
use crate::sqlstate::DbError;

/// Failures already seen in a batch, by item (dedup mode: message and handler): reused, never
/// run again.
pub(crate) type Known<K> = HashMap<K, Failure>;

/// What became of one pass over a batch in one transaction.
pub(crate) enum Pass<K, T> {
    /// It committed; `T` says what became of each item.
    Done(T),
    /// A handler of item `K` failed (or panicked) and the transaction is given up.
    Failed(K, Failure),
    /// A handler returned `Ok` but left the transaction aborted.
    Aborted,
    /// PostgreSQL refused the commit.
    Refused(sqlx::Error),
}

/// A batch its ladder can handle.
pub(crate) trait Batch {
    /// What a failure is known by.
    type Key: Eq + Hash;
    /// What became of the batch.
    type Handled;
    /// Why it was not handled: the database's error, or what else the batch's kind can stop
    /// for (dedup mode: its lease lost).
    type Error: From<crate::Error>;

    /// Every item straight in one transaction (no savepoint unless a failure needs one).
    async fn together(
        &mut self,
        known: &mut Known<Self::Key>,
    ) -> Result<Pass<Self::Key, Self::Handled>, Self::Error>;

    /// One transaction, a savepoint per item: a failure undoes only its item's work. Failures
    /// in `known` are reused, not run again.
    async fn isolated(
        &mut self,
        known: &Known<Self::Key>,
    ) -> Result<Pass<Self::Key, Self::Handled>, Self::Error>;

    /// After a refused commit: each item in a transaction of its own ([`alone`]).
    async fn one_by_one(&mut self, known: &Known<Self::Key>) -> Result<Self::Handled, Self::Error>;
}

/// Handles `batch` down the ladder. On an error nothing of the batch is committed.
pub(crate) async fn handle<B: Batch>(batch: &mut B) -> Result<B::Handled, B::Error> {
    let mut known = Known::new();
    let mut isolate = false;
    loop {
        let pass = if isolate {
            batch.isolated(&known).await?
        } else {
            batch.together(&mut known).await?
        };
        match pass {
            Pass::Done(outcome) => return Ok(outcome),
            Pass::Failed(key, failure) => {
                // In a transaction shared by several items, a failure of the transaction (an
                // aborted one, a deadlock) may be another item's doing: judged again alone.
                if isolate || !matches!(failure, Failure::Transaction(_)) {
                    known.insert(key, failure);
                }
                isolate = true;
            }
            Pass::Aborted => {
                // Find the handler that did it, a savepoint each. A failure seen in the aborted
                // transaction may be its doing, not its handler's: judged again (a panic is not
                // run twice).
                known.retain(|_, failure| matches!(failure, Failure::Panicked(_)));
                isolate = true;
            }
            Pass::Refused(e) => {
                tracing::info!(error = %crate::error_chain(&e), "a batch was refused at commit; handling its items one by one");
                return batch.one_by_one(&known).await;
            }
        }
    }
}

/// Handles a batch of one item, with a savepoint per handler, until it commits (`Ok`) or its
/// commit is refused (`Err`: the refusal is the item's failure). A panic gives its transaction
/// up, and the item is done again with the panic known.
pub(crate) async fn alone<B: Batch>(
    one: &mut B,
    mut known: Known<B::Key>,
) -> Result<std::result::Result<B::Handled, sqlx::Error>, B::Error> {
    loop {
        match one.isolated(&known).await? {
            Pass::Done(outcome) => return Ok(Ok(outcome)),
            Pass::Failed(key, failure) => {
                known.insert(key, failure);
            }
            Pass::Refused(e) => return Ok(Err(e)),
            Pass::Aborted => unreachable!("an isolated pass finds the handler that aborted it"),
        }
    }
}

/// How an item's savepoint ended ([`settle`]).
pub(crate) enum Settled {
    /// Released: the item's work stays in the transaction.
    Kept,
    /// The item failed and its work is undone: its handler's failure (rolled back to the
    /// savepoint), or a handler that returned `Ok` but left the savepoint aborted (refused at
    /// its release, rolled back when the connection is next used).
    Undone(Failure),
    /// A handler panicked, a failure not `reused`: the savepoint is left as it is (the
    /// connection may be anywhere in a query) and the transaction must be given up.
    Panicked(Failure),
}

/// Ends an item's savepoint once its handlers ran (`result`), the step every isolated pass
/// takes per item (dedup mode: per message and handler; inbox mode: per row): released if they
/// succeeded, and if PostgreSQL refuses the release because a handler left the savepoint
/// aborted, the item fails with [`Failure::left_aborted`] naming `handlers()`; rolled back if
/// they failed. A failure `reused` (known from an earlier pass, not run again) is rolled back
/// even if it is a panic. An error is the database's.
pub(crate) async fn settle(
    savepoint: sqlx::Transaction<'_, sqlx::Postgres>,
    result: std::result::Result<(), Failure>,
    reused: bool,
    handlers: impl FnOnce() -> String,
) -> Result<Settled> {
    Ok(match result {
        Ok(()) => match savepoint.commit().await {
            Ok(()) => Settled::Kept,
            Err(e) if DbError::of(&e) == DbError::Aborted => {
                Settled::Undone(Failure::left_aborted(&handlers()))
            }
            Err(e) => return Err(e.into()),
        },
        // The connection may be anywhere in a query: give up this transaction.
        Err(failure @ Failure::Panicked(_)) if !reused => Settled::Panicked(failure),
        Err(failure) => {
            savepoint.rollback().await?;
            Settled::Undone(failure)
        }
    })
}
