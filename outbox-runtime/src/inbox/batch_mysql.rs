//! Dedup mode on MariaDB and MySQL: a batch of messages, their `processed_event` rows and their
//! handlers in one transaction, one commit whatever the handlers' faults.
//!
//! The core (`inbox/dedup.rs`) and the brokers are shared with PostgreSQL; this is the
//! database's part, the twin of `inbox/batch.rs` (SQL and all: the MySQL relay's split of loop
//! and statements would be two small files here), shaped by what InnoDB does differently:
//!
//! - **Straight first.** A batch runs every handler straight in its transaction, behind one
//!   savepoint set after its dedup rows and released with the commit: one round trip for the
//!   dedup rows' read, one for their insert, one for the commit, whatever the batch's size.
//! - **Then a savepoint per handler, after a failure.** A failed statement undoes itself only
//!   (PostgreSQL aborts the transaction), so there is no ladder: a handler that fails gives the
//!   straight pass up, and the batch is done again with each handler behind
//!   `SAVEPOINT _outbox_h`, set in the round trip that releases the one before; a handler that
//!   fails is rolled back to it (and its dedup row deleted) in one round trip, and the pass goes
//!   on, its failure known (not run again). A handler may so run twice for one delivery.
//! - **A deadlock rolls the whole transaction back**, and the session goes on outside it. A
//!   batch runs with autocommit off, so what a handler that caught the deadlock (and those after
//!   it) write next does not commit on its own: it waits in an implicit transaction. The
//!   release of the batch's savepoint at the commit fails then (1305, no such savepoint), the
//!   implicit transaction is rolled back, and the savepoint pass finds the handler (its own
//!   savepoint gone at its release): the batch is done again without it, its message failed.
//!   The connection goes back to the pool only with autocommit on again (else it is closed), and
//!   `@outbox_consumer_batch`, set meanwhile, lets `mysql::emit` in a handler write in a session
//!   whose autocommit is off.
//! - **No transaction-scoped named locks**: none are needed. `processed_event`'s primary key is
//!   `(event_id, handler)` (not partitioned), so a pair inserted by another transaction still
//!   open makes this insert wait, and fail with a duplicate key (1062) once it commits: the pass
//!   reads the pairs again and skips it. Rows are inserted in key order, so two batches of the
//!   same messages wait for each other rather than deadlock.
//!
//! A batch runs at READ COMMITTED (its reads see what committed before each statement), set for
//! its transaction only.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{Connection, Executor, MySqlConnection, MySqlPool, Row};
use tracing::Instrument;
use uuid::Uuid;

use super::batch::{Checked, Handled, Unhandled};
use super::database::Conn;
use super::failure::Failure;
use super::message::Incoming;
use super::route::{Route, Routes};
use super::settings::{Mode, Settings};
use crate::error::{Error, Result};
use crate::mysql::emit::{push_hex, push_text};

/// `processed_event.handler`'s length, in characters.
const HANDLER_CHARS: usize = 255;
/// The savepoint each handler runs behind.
const SAVEPOINT: &str = "SAVEPOINT _outbox_h";
/// No such savepoint: the transaction that held it is gone.
const NO_SAVEPOINT: u16 = 1305;
/// A duplicate key: another transaction inserted the pair and committed.
const DUPLICATE_KEY: u16 = 1062;
/// Times a pass reads the pairs again after a duplicate key before it gives the batch up.
const DUPLICATE_RETRIES: usize = 8;

/// What `build` refuses of a consumer on MariaDB/MySQL: what is built on PostgreSQL only so
/// far, and handler keys longer than `processed_event.handler` holds.
pub(crate) fn check(settings: &Settings, routes: &Routes, reads_under_lease: bool) -> Result<()> {
    if settings.mode == Mode::Inbox {
        return Err(Error::Config(
            "inbox mode is not built on MariaDB/MySQL yet: a consumer on a `MySqlPool` runs in \
             dedup mode (`Mode::Dedup`, the default)"
                .into(),
        ));
    }
    if reads_under_lease {
        return Err(Error::Config(
            "a JetStream consumer is not built on MariaDB/MySQL yet (its group reads each topic \
             under a lease table there is no MariaDB/MySQL version of); read from Kafka or \
             RabbitMQ"
                .into(),
        ));
    }
    if let Some(route) = routes.all().find(|r| r.key.chars().count() > HANDLER_CHARS) {
        return Err(Error::Config(format!(
            "the deduplication key `{}` is longer than `processed_event.handler` holds on \
             MariaDB/MySQL ({HANDLER_CHARS} characters): shorten the group or the handler's name",
            route.key
        )));
    }
    Ok(())
}

/// A (message, handler) pair of a batch: their indexes, the route and the message.
type Pair<'b, 'm> = (usize, usize, &'b Route, &'b Incoming<'m>);

/// Handles the messages; see the module's docs. `in_place`: a retryable failure stops the batch
/// there (what came before commits). An error is the database's: nothing of the batch
/// committed.
pub(crate) async fn handle(
    pool: &MySqlPool,
    routes: &Routes,
    messages: &[Checked<'_>],
    in_place: bool,
) -> std::result::Result<Handled, Unhandled> {
    let mut pairs = Vec::new();
    let mut bad = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        match message {
            Ok(incoming) => {
                let meta = &incoming.meta;
                for (h, route) in routes.get(meta.topic, &meta.event_type).iter().enumerate() {
                    pairs.push((i, h, route, incoming));
                }
            }
            Err(reason) => bad.push((i, Failure::Permanent(reason.clone()))),
        }
    }
    let outcome = || {
        let mut outcome = Handled::new(messages.len());
        for (i, failure) in &bad {
            outcome.fail(*i, failure.clone());
        }
        outcome
    };
    let mut session = Session::open(pool).await?;
    let handled = passes(&mut session, &pairs, in_place, outcome).await;
    session.restore().await;
    handled
}

/// The batch's passes on `session`: straight through, then, after a failure, with a
/// savepoint per handler until one commits.
async fn passes(
    session: &mut Session,
    pairs: &[Pair<'_, '_>],
    in_place: bool,
    outcome: impl Fn() -> Handled,
) -> std::result::Result<Handled, Unhandled> {
    let mut known = HashMap::new();
    match straight(session, pairs, outcome()).await? {
        Straight::Done(outcome) => return Ok(outcome),
        Straight::Failed(Some((key, failure))) => {
            known.insert(key, failure);
        }
        Straight::Failed(None) => {}
    }
    loop {
        match pass(session, pairs, &known, in_place, outcome()).await? {
            Pass::Done(outcome) => return Ok(outcome),
            Pass::Again(key, failure) => {
                tracing::debug!(
                    error = failure.message(),
                    "a batch's transaction was lost; handling it again"
                );
                known.insert(key, failure);
            }
        }
    }
}

/// What became of the straight pass.
enum Straight {
    Done(Handled),
    /// A handler failed (its pair and failure, unless the failure may be another's doing: a
    /// deadlock), or the transaction was found gone at the commit: nothing committed.
    Failed(Option<((usize, usize), Failure)>),
}

/// The first pass: every handler straight in the transaction, no savepoint but the batch's
/// own (set after the dedup rows, released with the commit: gone if the server rolled the
/// transaction back under a handler). Any failure gives it up for [`pass`].
async fn straight(
    session: &mut Session,
    pairs: &[Pair<'_, '_>],
    mut outcome: Handled,
) -> std::result::Result<Straight, Unhandled> {
    let mut tx = Connection::begin_with(session.begin(), BEGIN).await?;
    let candidates: Vec<(Uuid, &str)> = pairs
        .iter()
        .map(|(_, _, route, incoming)| (incoming.meta.event_id, route.key.as_str()))
        .collect();
    let mut new = insert_new(&mut tx, &candidates).await?;
    let mut ran = false;
    for &(i, h, route, incoming) in pairs {
        let meta = &incoming.meta;
        if !new.remove(&(meta.event_id, route.key.as_str())) {
            outcome.duplicates += 1;
            continue;
        }
        ran = true;
        match call(route, incoming, &mut tx).await {
            Ok(()) => outcome.processed += 1,
            Err(failure) => {
                discard(tx).await;
                let known = !matches!(failure, Failure::Transaction(_));
                return Ok(Straight::Failed(known.then_some(((i, h), failure))));
            }
        }
    }
    let commit = if ran {
        "RELEASE SAVEPOINT _outbox_h; COMMIT"
    } else {
        "COMMIT"
    };
    match run(&mut tx, commit).await {
        Ok(()) => Ok(Straight::Done(outcome)),
        Err(e) => {
            discard(tx).await;
            if number(&e) == Some(NO_SAVEPOINT) {
                tracing::debug!(
                    "a batch's transaction was rolled back under a handler; finding which"
                );
                Ok(Straight::Failed(None))
            } else {
                Err(e.into())
            }
        }
    }
}

/// What became of one pass over a batch.
enum Pass {
    Done(Handled),
    /// The transaction was lost (or given up after a panic) at pair `(message, handler)`,
    /// which failed so: start over with it known.
    Again((usize, usize), Failure),
}

/// A pass after a failure: the pairs in one transaction, a savepoint each; `known` failures
/// not run again.
async fn pass(
    session: &mut Session,
    pairs: &[Pair<'_, '_>],
    known: &HashMap<(usize, usize), Failure>,
    in_place: bool,
    mut outcome: Handled,
) -> std::result::Result<Pass, Unhandled> {
    let mut tx = Connection::begin_with(session.begin(), BEGIN).await?;
    let candidates: Vec<(Uuid, &str)> = pairs
        .iter()
        .filter(|(i, h, ..)| !known.contains_key(&(*i, *h)))
        .map(|(_, _, route, incoming)| (incoming.meta.event_id, route.key.as_str()))
        .collect();
    let mut new = insert_new(&mut tx, &candidates).await?;
    // The handler that ran last returned `Ok` behind the savepoint, not yet released: the
    // release says whether the transaction is still there.
    let mut unreleased: Option<((usize, usize), &Route)> = None;
    for &(i, h, route, incoming) in pairs {
        let meta = &incoming.meta;
        let failure = if let Some(failure) = known.get(&(i, h)) {
            failure.clone()
        } else if !new.remove(&(meta.event_id, route.key.as_str())) {
            outcome.duplicates += 1;
            continue;
        } else {
            if let Some((key, before)) = unreleased.take() {
                if let Err(e) = run(
                    &mut tx,
                    &format!("RELEASE SAVEPOINT _outbox_h; {SAVEPOINT}"),
                )
                .await
                {
                    return lost(tx, e, key, before).await;
                }
            }
            match call(route, incoming, &mut tx).await {
                Ok(()) => {
                    outcome.processed += 1;
                    unreleased = Some(((i, h), route));
                    continue;
                }
                Err(failure @ Failure::Panicked(_)) => {
                    // The connection may be anywhere in a query: give the transaction up.
                    discard(tx).await;
                    return Ok(Pass::Again((i, h), failure));
                }
                Err(failure) => {
                    let mut undo = String::from("ROLLBACK TO SAVEPOINT _outbox_h; ");
                    undo.push_str("DELETE FROM processed_event WHERE event_id = X'");
                    push_hex(&mut undo, meta.event_id.as_bytes());
                    undo.push_str("' AND handler = ");
                    push_text(&mut undo, &route.key);
                    // Set again after the delete, so that the next handler's rollback keeps it.
                    let _ = write!(undo, "; {SAVEPOINT}");
                    if let Err(e) = run(&mut tx, &undo).await {
                        if number(&e) == Some(NO_SAVEPOINT) {
                            // A deadlock (the handler's error) rolled everything back.
                            discard(tx).await;
                            return Ok(Pass::Again((i, h), failure));
                        }
                        discard(tx).await;
                        return Err(e.into());
                    }
                    failure
                }
            }
        };
        if in_place && !failure.is_permanent() {
            outcome.done = i;
            outcome.stopped = Some(failure);
            outcome.failed.retain(|(j, _)| *j < i);
            break;
        }
        outcome.fail(i, failure);
    }
    let mut commit = String::new();
    if unreleased.is_some() {
        commit.push_str("RELEASE SAVEPOINT _outbox_h; ");
    }
    if !new.is_empty() {
        // Stopped in place: the pairs not run keep no dedup row.
        commit.push_str("DELETE FROM processed_event WHERE (event_id, handler) IN (");
        for (n, (id, key)) in new.iter().enumerate() {
            commit.push_str(if n == 0 { "(X'" } else { ", (X'" });
            push_hex(&mut commit, id.as_bytes());
            commit.push_str("', ");
            push_text(&mut commit, key);
            commit.push(')');
        }
        commit.push_str("); ");
    }
    commit.push_str("COMMIT");
    match run(&mut tx, &commit).await {
        Ok(()) => Ok(Pass::Done(outcome)),
        Err(e) => match unreleased {
            Some((key, before)) => lost(tx, e, key, before).await,
            None => {
                discard(tx).await;
                Err(e.into())
            }
        },
    }
}

/// The release of the savepoint of the handler `before` (pair `key`), which returned `Ok`,
/// failed with `error`: if the savepoint is gone, so is the transaction (a deadlock the handler
/// caught), and the pass starts over with that handler failed; else the database's error.
async fn lost(
    tx: sqlx::Transaction<'_, sqlx::MySql>,
    error: sqlx::Error,
    key: (usize, usize),
    before: &Route,
) -> std::result::Result<Pass, Unhandled> {
    discard(tx).await;
    if number(&error) != Some(NO_SAVEPOINT) {
        return Err(error.into());
    }
    Ok(Pass::Again(
        key,
        Failure::Retryable(format!(
            "handler `{}` returned Ok, but the server had rolled its transaction back (a \
             deadlock or a lock wait timeout whose error it caught): what it wrote after that \
             committed on its own; let such an error end the handler (`?`)",
            before.handler.name()
        )),
    ))
}

/// Inserts the pairs `processed_event` does not hold yet, in key order, and sets the first
/// handler's savepoint; returns the pairs it inserted (each once, however often the batch
/// holds it).
async fn insert_new<'k>(
    conn: &mut MySqlConnection,
    candidates: &[(Uuid, &'k str)],
) -> std::result::Result<HashSet<(Uuid, &'k str)>, Unhandled> {
    let mut tries = 0;
    loop {
        let mut new: Vec<(Uuid, &str)> = candidates.to_vec();
        new.sort_unstable();
        new.dedup();
        if new.is_empty() {
            return Ok(HashSet::new());
        }
        let mut select = String::from(
            "SELECT event_id, CAST(handler AS CHAR) FROM processed_event WHERE event_id IN (",
        );
        let mut ids: Vec<Uuid> = new.iter().map(|(id, _)| *id).collect();
        ids.dedup();
        for (n, id) in ids.iter().enumerate() {
            select.push_str(if n == 0 { "X'" } else { ", X'" });
            push_hex(&mut select, id.as_bytes());
            select.push('\'');
        }
        select.push(')');
        let seen: HashSet<(Uuid, String)> = conn
            .fetch_all(sqlx::raw_sql(&select))
            .await?
            .iter()
            .map(|row| Ok((row.try_get::<Uuid, _>(0)?, row.try_get::<String, _>(1)?)))
            .collect::<std::result::Result<_, sqlx::Error>>()?;
        new.retain(|(id, key)| !seen.contains(&(*id, (*key).to_owned())));
        if new.is_empty() {
            return Ok(HashSet::new());
        }
        let mut insert =
            String::from("INSERT INTO processed_event (event_id, handler, processed_at) VALUES ");
        for (n, (id, key)) in new.iter().enumerate() {
            insert.push_str(if n == 0 { "(X'" } else { ", (X'" });
            push_hex(&mut insert, id.as_bytes());
            insert.push_str("', ");
            push_text(&mut insert, key);
            insert.push_str(", UTC_TIMESTAMP(6))");
        }
        let _ = write!(insert, "; {SAVEPOINT}");
        match run(conn, &insert).await {
            Ok(()) => return Ok(new.into_iter().collect()),
            // Another transaction inserted one of them and committed since the read.
            Err(e) if number(&e) == Some(DUPLICATE_KEY) && tries < DUPLICATE_RETRIES => {
                tries += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Begins a batch: autocommit off for it, so that what a handler writes after the server rolled
/// the transaction back (a deadlock it caught) does not commit on its own but waits in an
/// implicit transaction, rolled back when the batch finds its savepoint gone; and
/// `@outbox_consumer_batch` set, which tells `mysql::emit` in a handler that the batch checks
/// its transaction itself. Then READ COMMITTED for this transaction.
const BEGIN: &str = "SET autocommit = 0, @outbox_consumer_batch = 1; \
                     SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// The session as the pool gave it, once the batch is done.
const RESTORE: &str = "SET autocommit = 1, @outbox_consumer_batch = NULL";

/// A batch's connection, which goes back to the pool only with its session restored
/// ([`RESTORE`]): a batch dropped half way (its consumer cancelled) or whose connection failed
/// closes it instead, so that no one else gets a session with autocommit off.
struct Session {
    conn: Option<sqlx::pool::PoolConnection<sqlx::MySql>>,
    restored: bool,
}

impl Session {
    async fn open(pool: &MySqlPool) -> std::result::Result<Session, sqlx::Error> {
        Ok(Session {
            conn: Some(pool.acquire().await?),
            restored: true,
        })
    }

    /// The connection, to begin a batch's transaction on ([`BEGIN`]).
    fn begin(&mut self) -> &mut MySqlConnection {
        self.restored = false;
        self.conn.as_mut().expect("open until dropped")
    }

    /// Restores the session; if it cannot, the connection is closed when this drops.
    async fn restore(&mut self) {
        if self.restored {
            return;
        }
        let conn = self.conn.as_mut().expect("open until dropped");
        match run(conn, RESTORE).await {
            Ok(()) => self.restored = true,
            Err(e) => {
                tracing::debug!(error = %crate::error_chain(&e), "cannot restore a batch's session; closing its connection")
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            if !self.restored {
                drop(conn.detach());
            }
        }
    }
}

/// Runs `route`'s handler on `incoming` in the transaction `conn` is in, in its span.
async fn call(
    route: &Route,
    incoming: &Incoming<'_>,
    conn: &mut MySqlConnection,
) -> std::result::Result<(), Failure> {
    let meta = &incoming.meta;
    let span = super::meta::parented(
        tracing::info_span!("outbox_consume", event_id = %meta.event_id,
            handler = route.handler.name()),
        meta,
    );
    route
        .handle(incoming.payload, Conn::MySql(conn), meta)
        .instrument(span)
        .await
}

/// Runs a round trip of several statements; the server stops at the first that fails.
async fn run(conn: &mut MySqlConnection, sql: &str) -> std::result::Result<(), sqlx::Error> {
    conn.execute(sqlx::raw_sql(sql)).await.map(drop)
}

/// The server's error number of `error`, if it is the server's.
fn number(error: &sqlx::Error) -> Option<u16> {
    match error {
        sqlx::Error::Database(e) => e
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(|e| e.number()),
        _ => None,
    }
}

/// Rolls a transaction given up on back now (dropped, it would be rolled back only when its
/// connection is next used, holding its locks meanwhile).
async fn discard(tx: sqlx::Transaction<'_, sqlx::MySql>) {
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %crate::error_chain(&e), "cannot roll back a transaction given up on; its connection is closed");
    }
}

#[cfg(feature = "kafka")]
/// Records the group's missing retry and dead-letter topics (`topic`, `source_topic`, `role`),
/// replacing what it recorded before.
pub(crate) async fn record_missing_topics(
    pool: &MySqlPool,
    group: &str,
    missing: &[&(String, String, &'static str)],
) -> Result<()> {
    let mut sql = String::from("DELETE FROM outbox_consumer_missing_topic WHERE group_id = ");
    push_text(&mut sql, group);
    if !missing.is_empty() {
        sql.push_str(" AND topic NOT IN (");
        for (n, (topic, ..)) in missing.iter().enumerate() {
            if n > 0 {
                sql.push_str(", ");
            }
            push_text(&mut sql, topic);
        }
        sql.push_str(
            "); INSERT INTO outbox_consumer_missing_topic \
                      (group_id, topic, source_topic, role, seen_at) VALUES ",
        );
        for (n, (topic, source, role)) in missing.iter().enumerate() {
            sql.push_str(if n == 0 { "(" } else { ", (" });
            for value in [group, topic.as_str(), source.as_str(), role] {
                push_text(&mut sql, value);
                sql.push_str(", ");
            }
            sql.push_str("UTC_TIMESTAMP(6))");
        }
        sql.push_str(" ON DUPLICATE KEY UPDATE topic = topic");
    }
    pool.execute(sqlx::raw_sql(&sql)).await?;
    Ok(())
}
