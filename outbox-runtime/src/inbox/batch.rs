//! Dedup mode's database work: a batch of messages, their `processed_event` rows and their
//! handlers, in one transaction and one commit whatever the handlers' faults.
//!
//! The batch runs in segments, each straight in the transaction (all its dedup rows in one
//! statement, every handler without a savepoint). The first segment is the whole batch. If a
//! handler fails, its segment is undone (the transaction rolled back, or back to the savepoint
//! taken before the segment once the transaction holds work to keep), the messages before the
//! failing one run again as a segment, the failing message runs alone (a savepoint per
//! handler: a failure undoes only its own work; a failure already seen is reused, not run
//! again), and the next segment starts after it. So each message runs at most twice, and a
//! failure costs a savepoint and a rerun of the part of its segment before it, not a commit.
//! A panic gives the transaction up (the connection may be anywhere in a query) and starts
//! over, the panic known (never run twice). If a handler returned `Ok` but left the
//! transaction aborted, the batch is done again with a savepoint per message and handler, to
//! find it. If the commit itself is refused (a deferred constraint), each message gets a
//! transaction of its own, to find the one it was.
//!
//! The statements are `store/`'s: the dedup rows and the source locks in `store/dedup.rs`
//! (over `store/source_lock.rs`), the lease's fence in `store/lease.rs`.

use std::collections::{BTreeSet, HashSet};

use sqlx::{Connection, PgConnection, PgPool};
use tracing::Instrument;
use uuid::Uuid;

use super::database::Conn;
use super::failure::Failure;
use super::ladder::{self, Batch, Pass, Settled};
use super::message::Incoming;
use super::route::Routes;
use crate::error::Error;
use crate::sqlstate::DbError;
use crate::store::{dedup, source_lock};

/// A message of a batch: checked, or the reason it is bad.
pub(crate) type Checked<'m> = std::result::Result<Incoming<'m>, String>;

/// What became of a batch, or of its first `done` messages.
#[derive(Debug, Default)]
pub(crate) struct Handled {
    /// Messages from the start of the batch that are done: committed, or failed (`failed`).
    pub done: usize,
    /// Failures among the first `done` messages, one per message, to retry or dead-letter.
    pub failed: Vec<(usize, Failure)>,
    /// Retried in place: the message at `done` failed retryably and waits for its retry.
    pub stopped: Option<Failure>,
    pub processed: u64,
    pub duplicates: u64,
}

impl Handled {
    pub(crate) fn new(messages: usize) -> Self {
        Handled {
            done: messages,
            ..Handled::default()
        }
    }

    /// Adds `part`, the outcome of the messages from `offset` on. `false` if it stopped there
    /// (in place): so does the whole.
    fn absorb(&mut self, part: Handled, offset: usize) -> bool {
        self.processed += part.processed;
        self.duplicates += part.duplicates;
        for (i, failure) in part.failed {
            self.fail(offset + i, failure);
        }
        match part.stopped {
            Some(failure) => {
                self.stop_at(offset + part.done, failure);
                false
            }
            None => true,
        }
    }

    /// Retried in place: stops at the message at `index`, which failed retryably; what came
    /// before it stays done, with its failures.
    pub(crate) fn stop_at(&mut self, index: usize, failure: Failure) {
        self.done = index;
        self.stopped = Some(failure);
        self.failed.retain(|(j, _)| *j < index);
    }

    /// Records a message's failure; of several, a retryable one wins (the others' handlers
    /// are deduplicated when it is tried again).
    pub(crate) fn fail(&mut self, index: usize, failure: Failure) {
        match self.failed.iter_mut().find(|(i, _)| *i == index) {
            Some((_, seen)) if seen.is_permanent() && !failure.is_permanent() => *seen = failure,
            Some(_) => {}
            None => self.failed.push((index, failure)),
        }
    }
}

/// Failures already seen, by (message, handler) index: not run again.
type Known = ladder::Known<(usize, usize)>;

/// What became of a pass ([`chained`]) that gave its transaction up.
enum Chained {
    Pass(Pass<(usize, usize), Handled>),
    /// A handler panicked: the transaction was given up (the panic is known now, and never
    /// run again); the batch starts over.
    Panicked,
}

/// Handles the messages: see the module documentation. `in_place`: a retryable failure stops
/// the batch there (what came before commits). An error is the database's (nothing lost: the
/// offsets are not stored, and the dedup rows make doing it again harmless).
///
/// With a `fence`, every transaction checks first that the lease is still owned, and fails with
/// [`Unhandled::LeaseLost`] if it is not.
pub(crate) async fn handle(
    pool: &PgPool,
    routes: &Routes,
    messages: &[Checked<'_>],
    in_place: bool,
    fence: Option<&Fence<'_>>,
) -> Result<Handled> {
    ladder::handle(&mut Messages {
        pool,
        routes,
        messages,
        in_place,
        fence,
    })
    .await
}

/// A lease ([`outbox_consumer_lease`](crate::inbox)) a batch's transactions must own: checked
/// in each before any work, `FOR KEY SHARE`, so that no instance takes it over (`FOR UPDATE`)
/// before the transaction ends, while its holder still renews it (an update of no key column)
/// during a batch longer than the lease.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fence<'a> {
    pub group: &'a str,
    pub topic: &'a str,
    pub holder: Uuid,
}

/// Why a batch was not handled (nothing of it committed).
#[derive(Debug)]
pub(crate) enum Unhandled {
    /// The database failed: the batch is to be done again.
    Database(Error),
    /// The fence found the lease gone: another instance reads the topic now.
    LeaseLost,
}

impl From<Error> for Unhandled {
    fn from(e: Error) -> Self {
        Unhandled::Database(e)
    }
}

impl From<sqlx::Error> for Unhandled {
    fn from(e: sqlx::Error) -> Self {
        Unhandled::Database(e.into())
    }
}

/// This file's results: [`Unhandled`] on error.
type Result<T, E = Unhandled> = std::result::Result<T, E>;

/// A dedup-mode batch, as the [`ladder`] handles it.
#[derive(Clone, Copy)]
struct Messages<'a, 'm> {
    pool: &'a PgPool,
    routes: &'a Routes,
    messages: &'a [Checked<'m>],
    in_place: bool,
    fence: Option<&'a Fence<'a>>,
}

impl Batch for Messages<'_, '_> {
    type Key = (usize, usize);
    type Handled = Handled;
    type Error = Unhandled;

    /// In segments ([`chained`]), starting over after a panic.
    async fn together(&mut self, known: &mut Known) -> Result<Pass<Self::Key, Handled>> {
        loop {
            let chained = chained(*self, known);
            if let Chained::Pass(pass) = chained.await? {
                return Ok(pass);
            }
        }
    }

    async fn isolated(&mut self, known: &Known) -> Result<Pass<Self::Key, Handled>> {
        let mut tx = begin(*self).await?;
        let outcome =
            match isolated_in(&mut tx, self.routes, self.messages, known, self.in_place).await? {
                Isolated::Done(outcome) => outcome,
                Isolated::Panicked(i, h, failure) => {
                    discard(tx).await;
                    return Ok(Pass::Failed((i, h), failure));
                }
            };
        Ok(match crate::uow::commit_checked(tx).await {
            Ok(()) => Pass::Done(outcome),
            Err(Error::Commit { source, .. }) => Pass::Refused(source),
            Err(e) => return Err(e.into()),
        })
    }

    async fn one_by_one(&mut self, known: &Known) -> Result<Handled> {
        let mut outcome = Handled::new(self.messages.len());
        for (i, message) in self.messages.iter().enumerate() {
            let mut one = Messages {
                messages: std::slice::from_ref(message),
                ..*self
            };
            let failure = match ladder::alone(&mut one, slice_of(known, i, 1)).await? {
                Ok(single) => {
                    outcome.processed += single.processed;
                    outcome.duplicates += single.duplicates;
                    if let Some(failure) = single.stopped {
                        Some(failure)
                    } else {
                        for (_, failure) in single.failed {
                            outcome.fail(i, failure);
                        }
                        None
                    }
                }
                Err(refused) => Some(Failure::refused_at_commit(&refused)),
            };
            if let Some(failure) = failure {
                if self.in_place && !failure.is_permanent() {
                    outcome.done = i;
                    outcome.stopped = Some(failure);
                    return Ok(outcome);
                }
                outcome.fail(i, failure);
            }
        }
        Ok(outcome)
    }
}

/// The batch in one transaction, in segments: each segment straight in the transaction
/// (behind a savepoint once the transaction holds work to keep); a handler that fails ends its
/// segment, which is undone and done again up to the failing message, which then goes alone
/// (a savepoint per handler, its failure reused), and the next segment starts after it. Each
/// message runs at most twice, and the batch commits once.
async fn chained(batch: Messages<'_, '_>, known: &mut Known) -> Result<Chained> {
    let Messages {
        routes,
        messages,
        in_place,
        ..
    } = batch;
    let n = messages.len();
    let mut outcome = Handled::new(n);
    // Messages to handle alone: those whose failure is known.
    let mut alone: BTreeSet<usize> = known.keys().map(|(i, _)| *i).collect();
    let mut tx = begin(batch).await?;
    // Whether the transaction holds work to keep: a segment then runs behind a savepoint.
    let mut kept = false;
    let mut start = 0;
    while start < n {
        if alone.remove(&start) {
            let one = &messages[start..=start];
            let seen = slice_of(known, start, 1);
            match aborted_as_none(isolated_in(&mut tx, routes, one, &seen, in_place).await)? {
                None => {
                    discard(tx).await;
                    return Ok(Chained::Pass(Pass::Aborted));
                }
                Some(Isolated::Panicked(_, h, failure)) => {
                    known.insert((start, h), failure);
                    discard(tx).await;
                    return Ok(Chained::Panicked);
                }
                Some(Isolated::Done(part)) => {
                    kept = true;
                    if !outcome.absorb(part, start) {
                        break;
                    }
                }
            }
            start += 1;
            continue;
        }
        let end = alone.range(start..).next().copied().unwrap_or(n);
        let segment = &messages[start..end];
        let failed = if kept {
            let Some(mut savepoint) = aborted_as_none(Connection::begin(&mut *tx).await)? else {
                discard(tx).await;
                return Ok(Chained::Pass(Pass::Aborted));
            };
            match optimistic_in(&mut savepoint, routes, segment).await? {
                Ok(part) => {
                    if aborted_as_none(savepoint.commit().await)?.is_none() {
                        discard(tx).await;
                        return Ok(Chained::Pass(Pass::Aborted));
                    }
                    outcome.absorb(part, start);
                    None
                }
                Err(failed) => {
                    if !matches!(failed.2, Failure::Panicked(_)) {
                        savepoint.rollback().await?;
                    }
                    Some(failed)
                }
            }
        } else {
            match optimistic_in(&mut tx, routes, segment).await? {
                Ok(part) => {
                    outcome.absorb(part, start);
                    None
                }
                Err(failed) => Some(failed),
            }
        };
        let Some((i, h, failure)) = failed else {
            kept = true;
            start = end;
            continue;
        };
        if matches!(failure, Failure::Panicked(_)) {
            // The connection may be anywhere in a query: give up this transaction.
            known.insert((start + i, h), failure);
            discard(tx).await;
            return Ok(Chained::Panicked);
        }
        if !kept {
            discard(tx).await;
            tx = begin(batch).await?;
        }
        // What came before it went well: it goes again, then this message alone. A failure
        // that may be the transaction's doing (an aborted transaction, a deadlock) is judged
        // again there.
        if !matches!(failure, Failure::Transaction(_)) {
            known.insert((start + i, h), failure);
        }
        alone.insert(start + i);
    }
    Ok(Chained::Pass(match crate::uow::commit_checked(tx).await {
        Ok(()) => Pass::Done(outcome),
        Err(Error::Aborted { .. }) => Pass::Aborted,
        Err(Error::Commit { source, .. }) => Pass::Refused(source),
        Err(e) => return Err(e.into()),
    }))
}

/// Begins a batch's transaction: at READ COMMITTED whatever the role's default, holding a
/// transaction-scoped advisory lock per handler and source (topic and partition) of the
/// messages, taken in one order so that two batches never deadlock.
///
/// What keeps a (event, handler) pair handled once when `processed_event` is partitioned (its
/// unique key then contains `processed_at`, so two rows of the pair in different partitions
/// would not conflict): the same message in two consumers at once (one the group replaced,
/// finishing its batch; or a retried copy, locked by the partition its original was read
/// from, handled while a consumer that died before storing the original's offset has it
/// redelivered) takes the same lock, so the second waits for the first to end, and
/// its insert, a statement that starts after that (READ COMMITTED: a snapshot per statement),
/// sees the first's row in whichever partition, and skips the pair. On an unpartitioned table
/// the unique key does it too.
///
/// With a fence, it first checks the lease ([`Fence`]).
async fn begin(batch: Messages<'_, '_>) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let Messages {
        pool,
        routes,
        messages,
        fence,
        ..
    } = batch;
    let sources: BTreeSet<String> = messages
        .iter()
        .filter_map(|m| m.as_ref().ok())
        .flat_map(|incoming| {
            let meta = &incoming.meta;
            routes
                .get(meta.topic, &meta.event_type)
                .iter()
                .map(|route| {
                    format!(
                        "{}\u{1f}{}\u{1f}{}",
                        route.key,
                        meta.topic,
                        incoming.source_partition.unwrap_or(-1)
                    )
                })
        })
        .collect();
    let sources: Vec<String> = sources.into_iter().collect();
    let mut tx = source_lock::begin(pool).await?;
    let fence = fence.map(|f| (f.group, f.topic, f.holder));
    if !dedup::lock_sources(&mut tx, &sources, fence).await? {
        discard(tx).await;
        return Err(Unhandled::LeaseLost);
    }
    Ok(tx)
}

/// `None` for an error that says the transaction is aborted.
fn aborted_as_none<T, E: Into<Error>>(
    result: std::result::Result<T, E>,
) -> crate::Result<Option<T>> {
    match result.map_err(Into::into) {
        Ok(value) => Ok(Some(value)),
        Err(Error::Database(e)) if DbError::of(&e) == DbError::Aborted => Ok(None),
        Err(e) => Err(e),
    }
}

/// The failures known of messages `start..start + len`, indexed from `start`.
fn slice_of(known: &Known, start: usize, len: usize) -> Known {
    known
        .iter()
        .filter(|((i, _), _)| (start..start + len).contains(i))
        .map(|((i, h), f)| ((i - start, *h), f.clone()))
        .collect()
}

/// The messages straight in the transaction, no savepoints: their outcome, or the first
/// failure (message, handler), after which the transaction must be rolled back.
async fn optimistic_in(
    conn: &mut PgConnection,
    routes: &Routes,
    messages: &[Checked<'_>],
) -> Result<std::result::Result<Handled, (usize, usize, Failure)>> {
    let mut outcome = Handled::new(messages.len());
    let mut work = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        match message {
            Ok(incoming) => {
                for (h, route) in routes
                    .get(incoming.meta.topic, &incoming.meta.event_type)
                    .iter()
                    .enumerate()
                {
                    work.push((i, h, route, incoming));
                }
            }
            Err(reason) => outcome.fail(i, Failure::Permanent(reason.clone())),
        }
    }
    if work.is_empty() {
        return Ok(Ok(outcome));
    }
    let ids: Vec<Uuid> = work.iter().map(|w| w.3.meta.event_id).collect();
    let keys: Vec<&str> = work.iter().map(|w| w.2.key.as_str()).collect();
    let new = dedup::insert_new(&mut *conn, &ids, &keys).await?;
    let mut new: HashSet<(Uuid, String)> = new.into_iter().collect();
    for (i, h, route, incoming) in work {
        // Each new row runs its handler once, even if the batch holds the event twice.
        if !new.remove(&(incoming.meta.event_id, route.key.clone())) {
            outcome.duplicates += 1;
            continue;
        }
        let span = super::meta::parented(
            tracing::info_span!("outbox_consume", event_id = %incoming.meta.event_id,
                handler = route.handler.name()),
            &incoming.meta,
        );
        let result = route
            .handle(incoming.payload, Conn::Postgres(&mut *conn), &incoming.meta)
            .instrument(span)
            .await;
        if let Err(failure) = result {
            return Ok(Err((i, h, failure)));
        }
        outcome.processed += 1;
    }
    Ok(Ok(outcome))
}

/// What became of messages handled with a savepoint per message and handler.
enum Isolated {
    Done(Handled),
    /// A handler panicked (not known before): the transaction must be given up.
    Panicked(usize, usize, Failure),
}

/// The messages with a savepoint per message and handler, in `conn`'s transaction.
async fn isolated_in(
    conn: &mut PgConnection,
    routes: &Routes,
    messages: &[Checked<'_>],
    known: &Known,
    in_place: bool,
) -> crate::Result<Isolated> {
    let mut outcome = Handled::new(messages.len());
    'messages: for (i, message) in messages.iter().enumerate() {
        let incoming = match message {
            Ok(incoming) => incoming,
            Err(reason) => {
                outcome.fail(i, Failure::Permanent(reason.clone()));
                continue;
            }
        };
        for (h, route) in routes
            .get(incoming.meta.topic, &incoming.meta.event_type)
            .iter()
            .enumerate()
        {
            let failure = if let Some(failure) = known.get(&(i, h)) {
                // Seen failing in this batch: neither run again nor asked of the database (if
                // another consumer handled the event meanwhile, its retry is a duplicate).
                failure.clone()
            } else {
                let mut savepoint = Connection::begin(&mut *conn).await?;
                let new =
                    dedup::insert_one(&mut savepoint, incoming.meta.event_id, &route.key).await?;
                if !new {
                    savepoint.commit().await?;
                    outcome.duplicates += 1;
                    continue;
                }
                let span = super::meta::parented(
                    tracing::info_span!("outbox_consume",
                        event_id = %incoming.meta.event_id, handler = route.handler.name()),
                    &incoming.meta,
                );
                let result = route
                    .handle(
                        incoming.payload,
                        Conn::Postgres(&mut savepoint),
                        &incoming.meta,
                    )
                    .instrument(span)
                    .await;
                // Never a failure known before: those take no savepoint.
                let name = || route.handler.name().to_owned();
                match ladder::settle(savepoint, result, false, name).await? {
                    Settled::Kept => {
                        outcome.processed += 1;
                        continue;
                    }
                    Settled::Undone(failure) => failure,
                    Settled::Panicked(failure) => return Ok(Isolated::Panicked(i, h, failure)),
                }
            };
            if in_place && !failure.is_permanent() {
                outcome.stop_at(i, failure);
                break 'messages;
            }
            outcome.fail(i, failure);
        }
    }
    Ok(Isolated::Done(outcome))
}

/// Rolls back a transaction given up on, now: dropped, it would hold its locks (the rows it
/// claimed or inserted) until its connection is next used, and the next attempt, on another
/// connection, would skip or wait for them.
pub(crate) async fn discard<DB: sqlx::Database>(tx: sqlx::Transaction<'_, DB>) {
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %crate::error_chain(&e), "cannot roll back a transaction given up on; its connection is closed");
    }
}
