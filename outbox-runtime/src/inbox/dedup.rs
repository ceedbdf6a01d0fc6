//! Dedup mode's database work: a batch of messages, their `processed_event` rows and their
//! handlers, in as few transactions as the handlers' faults allow.
//!
//! First all of it in one transaction (all dedup rows in one statement, every handler straight
//! in the transaction). If a handler fails or panics, the transaction is rolled back, the
//! messages before the failing one go again in one transaction, the failing message on its
//! own (a savepoint per handler: a failure undoes only its own work; a failure already seen is
//! reused, not run again, so a panic is never run twice), and the rest goes on in one
//! transaction. So a failure costs about one more pass over the part of the batch before it,
//! not a savepoint per message. If a handler returned `Ok` but left the transaction aborted
//! (seen only at commit), the part is done again with a savepoint per message and handler, to
//! find it. If the commit itself is refused (a deferred constraint), each message gets a
//! transaction of its own, to find the one it was.

use std::collections::{BTreeSet, HashMap, HashSet};

use sqlx::{Connection, PgPool};
use tracing::Instrument;
use uuid::Uuid;

use super::handler::{Failure, Routes};
use super::message::Incoming;
use crate::error::{Error, Result};

/// A message of a batch: checked, or the reason it is bad.
pub(crate) type Checked<'m> = std::result::Result<Incoming<'m>, String>;

/// What became of a batch, or of its first `done` messages.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// Messages from the start of the batch that are done: committed, or failed (`failed`).
    pub done: usize,
    /// Failures among the first `done` messages, one per message, to retry or dead-letter.
    pub failed: Vec<(usize, Failure)>,
    /// Retried in place: the message at `done` failed retryably and waits for its retry.
    pub stopped: Option<Failure>,
    pub processed: u64,
    pub duplicates: u64,
}

impl Outcome {
    fn new(messages: usize) -> Self {
        Outcome {
            done: messages,
            ..Outcome::default()
        }
    }

    /// Adds `part`, the outcome of the messages from `offset` on. `false` if it stopped there
    /// (in place): so does the whole.
    fn absorb(&mut self, part: Outcome, offset: usize) -> bool {
        self.processed += part.processed;
        self.duplicates += part.duplicates;
        for (i, failure) in part.failed {
            self.fail(offset + i, failure);
        }
        match part.stopped {
            Some(failure) => {
                self.done = offset + part.done;
                self.failed.retain(|(i, _)| *i < self.done);
                self.stopped = Some(failure);
                false
            }
            None => true,
        }
    }

    /// Records a message's failure; of several, a retryable one wins (the others' handlers
    /// are deduplicated when it is tried again).
    fn fail(&mut self, index: usize, failure: Failure) {
        match self.failed.iter_mut().find(|(i, _)| *i == index) {
            Some((_, seen)) if seen.is_permanent() && !failure.is_permanent() => *seen = failure,
            Some(_) => {}
            None => self.failed.push((index, failure)),
        }
    }
}

/// Failures already seen, by (message, handler) index: not run again.
type Known = HashMap<(usize, usize), Failure>;

enum Attempt {
    Done(Outcome),
    /// A handler failed (or panicked) and its transaction is gone.
    Failed(usize, usize, Failure),
    /// The transaction was left aborted, by a handler that returned `Ok`.
    Aborted,
    /// PostgreSQL refused the commit.
    Refused(sqlx::Error),
}

/// Handles the messages: see the module documentation. `in_place`: a retryable failure stops
/// the batch there (what came before commits). An error is the database's (nothing lost: the
/// offsets are not stored, and the dedup rows make doing it again harmless).
pub(crate) async fn handle(
    pool: &PgPool,
    routes: &Routes,
    messages: &[Checked<'_>],
    in_place: bool,
) -> Result<Outcome> {
    let n = messages.len();
    let mut outcome = Outcome::new(n);
    // Failures seen, by (message, handler): reused, never run again.
    let mut known = Known::new();
    // Messages to handle on their own, with a savepoint per handler.
    let mut alone = BTreeSet::new();
    // The messages from `start` to `end` go next, in one transaction.
    let (mut start, mut end) = (0, n);
    while start < n {
        if alone.remove(&start) {
            let one = &messages[start..=start];
            let part =
                isolated_all(pool, routes, one, slice_of(&known, start, 1), in_place).await?;
            if !outcome.absorb(part, start) {
                return Ok(outcome);
            }
            start += 1;
            end = alone.range(start..).next().copied().unwrap_or(n);
            continue;
        }
        let segment = &messages[start..end];
        let part = match optimistic(pool, routes, segment).await? {
            Attempt::Done(part) => part,
            Attempt::Failed(i, h, failure) => {
                // What came before it went well: it goes again on its own, then this message
                // alone. A failure that may be the shared transaction's doing (an aborted
                // transaction, a deadlock) is judged again there.
                if !matches!(failure, Failure::Transaction(_)) {
                    known.insert((start + i, h), failure);
                }
                alone.insert(start + i);
                end = start + i;
                continue;
            }
            // A handler left the transaction aborted and returned `Ok`: find it, a savepoint
            // each.
            Attempt::Aborted => {
                let seen = slice_of(&known, start, segment.len());
                isolated_all(pool, routes, segment, seen, in_place).await?
            }
            Attempt::Refused(e) => {
                tracing::info!(error = %e, "a batch was refused at commit; handling its messages one by one");
                let seen = slice_of(&known, start, segment.len());
                one_by_one(pool, routes, segment, &seen, in_place).await?
            }
        };
        if !outcome.absorb(part, start) {
            return Ok(outcome);
        }
        start = end;
        end = alone.range(start..).next().copied().unwrap_or(n);
    }
    Ok(outcome)
}

/// The failures known of messages `start..start + len`, indexed from `start`.
fn slice_of(known: &Known, start: usize, len: usize) -> Known {
    known
        .iter()
        .filter(|((i, _), _)| (start..start + len).contains(i))
        .map(|((i, h), f)| ((i - start, *h), f.clone()))
        .collect()
}

/// The messages in one transaction, a savepoint per message and handler, until it commits or
/// is refused (then one by one).
async fn isolated_all(
    pool: &PgPool,
    routes: &Routes,
    messages: &[Checked<'_>],
    mut known: Known,
    in_place: bool,
) -> Result<Outcome> {
    loop {
        match isolated(pool, routes, messages, &known, in_place).await? {
            Attempt::Done(outcome) => return Ok(outcome),
            // A panic: its transaction is given up; never run it again.
            Attempt::Failed(i, h, failure) => {
                known.insert((i, h), failure);
            }
            Attempt::Refused(e) => {
                tracing::info!(error = %e, "refused at commit; handling the messages one by one");
                return one_by_one(pool, routes, messages, &known, in_place).await;
            }
            Attempt::Aborted => unreachable!("only the optimistic attempt reports it"),
        }
    }
}

/// Everything in one transaction, no savepoints.
async fn optimistic(pool: &PgPool, routes: &Routes, messages: &[Checked<'_>]) -> Result<Attempt> {
    let mut outcome = Outcome::new(messages.len());
    let mut work = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        match message {
            Ok(incoming) => {
                for (h, route) in routes
                    .get(incoming.topic, &incoming.event_type)
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
        return Ok(Attempt::Done(outcome));
    }
    let ids: Vec<Uuid> = work.iter().map(|w| w.3.event_id).collect();
    let keys: Vec<&str> = work.iter().map(|w| w.2.key.as_str()).collect();
    let mut tx = pool.begin().await?;
    let new: Vec<(Uuid, String)> = sqlx::query_as(
        "INSERT INTO processed_event (event_id, handler) \
         SELECT * FROM unnest($1::uuid[], $2::text[]) ON CONFLICT DO NOTHING \
         RETURNING event_id, handler",
    )
    .bind(&ids)
    .bind(&keys)
    .fetch_all(&mut *tx)
    .await?;
    let mut new: HashSet<(Uuid, String)> = new.into_iter().collect();
    for (i, h, route, incoming) in work {
        // Each new row runs its handler once, even if the batch holds the event twice.
        if !new.remove(&(incoming.event_id, route.key.clone())) {
            outcome.duplicates += 1;
            continue;
        }
        let span = tracing::info_span!("outbox_consume", event_id = %incoming.event_id,
            handler = route.handler.name());
        let result = route
            .handler
            .handle_json(incoming.payload, &mut tx)
            .instrument(span)
            .await;
        if let Err(failure) = result {
            discard(tx).await;
            return Ok(Attempt::Failed(i, h, failure));
        }
        outcome.processed += 1;
    }
    Ok(match crate::uow::commit_checked(tx).await {
        Ok(()) => Attempt::Done(outcome),
        Err(Error::Aborted { .. }) => Attempt::Aborted,
        Err(Error::Commit { source, .. }) => Attempt::Refused(source),
        Err(e) => return Err(e),
    })
}

/// One transaction, a savepoint per message and handler.
async fn isolated(
    pool: &PgPool,
    routes: &Routes,
    messages: &[Checked<'_>],
    known: &Known,
    in_place: bool,
) -> Result<Attempt> {
    let mut outcome = Outcome::new(messages.len());
    let mut tx = pool.begin().await?;
    'messages: for (i, message) in messages.iter().enumerate() {
        let incoming = match message {
            Ok(incoming) => incoming,
            Err(reason) => {
                outcome.fail(i, Failure::Permanent(reason.clone()));
                continue;
            }
        };
        for (h, route) in routes
            .get(incoming.topic, &incoming.event_type)
            .iter()
            .enumerate()
        {
            let mut savepoint = Connection::begin(&mut *tx).await?;
            let new = sqlx::query(
                "INSERT INTO processed_event (event_id, handler) VALUES ($1, $2) \
                 ON CONFLICT DO NOTHING",
            )
            .bind(incoming.event_id)
            .bind(&route.key)
            .execute(&mut *savepoint)
            .await?
            .rows_affected()
                == 1;
            if !new {
                savepoint.commit().await?;
                outcome.duplicates += 1;
                continue;
            }
            let result = match known.get(&(i, h)) {
                Some(failure) => Err(failure.clone()),
                None => {
                    let span = tracing::info_span!("outbox_consume",
                        event_id = %incoming.event_id, handler = route.handler.name());
                    route
                        .handler
                        .handle_json(incoming.payload, &mut savepoint)
                        .instrument(span)
                        .await
                }
            };
            let failure = match result {
                Ok(()) => match savepoint.commit().await {
                    Ok(()) => {
                        outcome.processed += 1;
                        continue;
                    }
                    Err(e) if is_aborted(&e) => Failure::left_aborted(route.handler.name()),
                    Err(e) => return Err(e.into()),
                },
                // The connection may be anywhere in a query: give up this transaction.
                Err(failure @ Failure::Panicked(_)) if !known.contains_key(&(i, h)) => {
                    drop(savepoint);
                    discard(tx).await;
                    return Ok(Attempt::Failed(i, h, failure));
                }
                Err(failure) => {
                    savepoint.rollback().await?;
                    failure
                }
            };
            if in_place && !failure.is_permanent() {
                outcome.done = i;
                outcome.stopped = Some(failure);
                outcome.failed.retain(|(j, _)| *j < i);
                break 'messages;
            }
            outcome.fail(i, failure);
        }
    }
    Ok(match crate::uow::commit_checked(tx).await {
        Ok(()) => Attempt::Done(outcome),
        Err(Error::Commit { source, .. }) => Attempt::Refused(source),
        Err(e) => return Err(e),
    })
}

/// After a refused commit: a transaction per message, so the refusal falls on its message.
async fn one_by_one(
    pool: &PgPool,
    routes: &Routes,
    messages: &[Checked<'_>],
    known: &Known,
    in_place: bool,
) -> Result<Outcome> {
    let mut outcome = Outcome::new(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let one = std::slice::from_ref(message);
        let mut seen: Known = known
            .iter()
            .filter(|((j, _), _)| *j == i)
            .map(|((_, h), f)| ((0, *h), f.clone()))
            .collect();
        let failure = loop {
            match isolated(pool, routes, one, &seen, in_place).await? {
                Attempt::Done(single) => {
                    outcome.processed += single.processed;
                    outcome.duplicates += single.duplicates;
                    if let Some(failure) = single.stopped {
                        break Some(failure);
                    }
                    for (_, failure) in single.failed {
                        outcome.fail(i, failure);
                    }
                    break None;
                }
                Attempt::Failed(_, h, failure) => {
                    seen.insert((0, h), failure);
                }
                Attempt::Refused(e) => break Some(refused_at_commit(&e)),
                Attempt::Aborted => unreachable!("only the optimistic attempt reports it"),
            }
        };
        if let Some(failure) = failure {
            if in_place && !failure.is_permanent() {
                outcome.done = i;
                outcome.stopped = Some(failure);
                return Ok(outcome);
            }
            outcome.fail(i, failure);
        }
    }
    Ok(outcome)
}

/// A failure found only at commit (a deferred constraint, a serialization failure): the
/// message's, not the database's. Integrity violations are permanent.
pub(crate) fn refused_at_commit(error: &sqlx::Error) -> Failure {
    let message = format!("the transaction of its handlers was refused at commit: {error}");
    match error {
        sqlx::Error::Database(e) if e.code().is_some_and(|c| c.starts_with("23")) => {
            Failure::Permanent(message)
        }
        _ => Failure::Retryable(message),
    }
}

/// Rolls back a transaction given up on, now: dropped, it would hold its locks (the rows it
/// claimed or inserted) until its connection is next used, and the next attempt, on another
/// connection, would skip or wait for them.
pub(crate) async fn discard(tx: sqlx::Transaction<'_, sqlx::Postgres>) {
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %e, "cannot roll back a transaction given up on; its connection is closed");
    }
}

/// The transaction is aborted (SQLSTATE 25P02): what a statement after a swallowed error gets.
pub(crate) fn is_aborted(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if e.code().as_deref() == Some("25P02"))
}
