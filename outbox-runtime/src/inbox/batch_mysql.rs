//! Dedup mode on MariaDB and MySQL: a batch of messages, their `processed_event` rows and their
//! handlers in one transaction, one commit whatever the handlers' faults.
//!
//! The core (`inbox/dedup.rs`) and the brokers are shared with PostgreSQL; this is the
//! database's part, the twin of `inbox/batch.rs` (SQL and all: the MySQL relay's split of loop
//! and statements would be two small files here), shaped by what InnoDB does differently:
//!
//! - **Straight first.** A batch runs every handler straight in its transaction, behind one
//!   savepoint set as it begins and released with its `COMMIT`: a round trip to begin, one to
//!   read which pairs are recorded already, and one for the commit, which inserts the dedup rows
//!   of the pairs that ran (after them: see below), whatever the batch's size.
//! - **Then a savepoint per handler, after a failure.** A failed statement undoes itself only
//!   (PostgreSQL aborts the transaction), so there is no ladder: a handler that fails gives the
//!   straight pass up, and the batch is done again with each handler behind
//!   `SAVEPOINT _outbox_h`, set (with the pair's dedup row) in the round trip that releases the
//!   one before; a handler that fails is rolled back to it, its row with it, and the pass goes
//!   on, its failure known (not run again). A handler may so run twice for one delivery.
//! - **A deadlock rolls the whole transaction back**, and the session goes on outside it. A
//!   batch runs with autocommit off, so what a handler that caught the deadlock (and those after
//!   it) write next does not commit on its own: it waits in an implicit transaction. The
//!   release of the batch's savepoint at the commit fails then (1305, no such savepoint), the
//!   implicit transaction is rolled back, and the savepoint pass finds the handler (its own
//!   savepoint gone at its release): the batch is done again without it, its message failed.
//!   A failure seen after such a rollback (a row it took away) is not its handler's: the
//!   straight pass checks the batch's savepoint before it blames one.
//! - **A handler that commits on its own** (DDL, `COMMIT`, `LOCK TABLES`) is found the same way.
//!   As no dedup row is written before its handler has run, nothing is recorded handled that
//!   did not run: the handlers before it in the straight pass committed without their rows and
//!   run again (their effects repeat), the rest once. Such statements have no place in a handler.
//! - **The session** goes back to the pool only with autocommit on again (else the connection
//!   is closed), and `@outbox_consumer_batch`, set meanwhile, lets `mysql::emit` in a handler
//!   write in a session whose autocommit is off.
//! - **No transaction-scoped named locks**: none are needed. `processed_event`'s primary key is
//!   `(event_id, handler)` (not partitioned), so a pair inserted by another transaction still
//!   open makes this insert wait, and fail with a duplicate key (1062) once it commits: the
//!   pair is a duplicate (the straight pass is done again, its reads fresh). Rows are inserted
//!   in key order, so two batches of the same messages wait for each other rather than
//!   deadlock; a batch's statements stay far below `max_allowed_packet` at the batch sizes
//!   consumers read (500 messages; 2 KiB a pair at most).
//!
//! - **A JetStream lease's fence** is checked by every transaction of a batch of a consumer
//!   that reads under one, in the round trip that reads which pairs are recorded, first: the
//!   lease's fence row, read with a shared lock held to the commit, must name this instance
//!   (`store/lease_mysql.rs`), else nothing of the batch commits.
//!
//! A batch runs at READ COMMITTED (its reads see what committed before each statement), set for
//! its transaction only.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{Connection, Executor, MySqlConnection, MySqlPool, Row};
use tracing::Instrument;
use uuid::Uuid;

use super::batch::{discard, Checked, Fence, Handled, Unhandled};
use super::database::Conn;
use super::failure::Failure;
use super::message::Incoming;
use super::route::{Route, Routes};
use super::settings::{Mode, Settings};
use crate::error::{Error, Result};
use crate::store::literal_mysql::{push_hex, push_text};

/// `processed_event.handler`'s length, in characters.
const HANDLER_CHARS: usize = 255;
/// The length of the group and the topic a JetStream lease's rows are keyed by, in characters.
const LEASE_NAME_CHARS: usize = 255;
/// The savepoint each handler runs behind.
const SAVEPOINT: &str = "SAVEPOINT _outbox_h";
/// No such savepoint: the transaction that held it is gone.
const NO_SAVEPOINT: u16 = 1305;
/// A duplicate key: another transaction inserted the pair and committed.
const DUPLICATE_KEY: u16 = 1062;

/// What `build` refuses of a consumer on MariaDB/MySQL: what is built on PostgreSQL only so
/// far, and handler keys (and a JetStream lease's group and topics) longer than their columns
/// hold.
pub(crate) fn check(settings: &Settings, routes: &Routes, reads_under_lease: bool) -> Result<()> {
    if settings.mode == Mode::Inbox {
        return Err(Error::Config(
            "inbox mode is not built on MariaDB/MySQL yet: a consumer on a `MySqlPool` runs in \
             dedup mode (`Mode::Dedup`, the default)"
                .into(),
        ));
    }
    if reads_under_lease {
        // The lease's rows are keyed by group and topic, each a `VARCHAR(255)`.
        let lease = "a JetStream consumer's lease";
        fits(
            "group",
            settings.group(),
            LEASE_NAME_CHARS,
            lease,
            "rename it",
        )?;
        for topic in routes.topics() {
            fits("topic", &topic, LEASE_NAME_CHARS, lease, "rename it")?;
        }
    }
    for route in routes.all() {
        let (column, fix) = (
            "`processed_event.handler`",
            "rename the handler or the group",
        );
        fits("deduplication key", &route.key, HANDLER_CHARS, column, fix)?;
    }
    Ok(())
}

/// Refuses a `name` that a `utf8mb4_bin` column of `chars` characters would not keep apart
/// from others: one ending with a space (the comparison pads, so `g` and `g ` are one) or one
/// too long for it. `fix`: what to do.
fn fits(what: &str, name: &str, chars: usize, column: &str, fix: &str) -> Result<()> {
    if name.ends_with(' ') {
        return Err(Error::Config(format!(
            "the {what} `{name}` ends with a space, which MariaDB/MySQL's comparison of \
             {column} ignores: {fix}"
        )));
    }
    if name.chars().count() > chars {
        return Err(Error::Config(format!(
            "the {what} `{name}` is longer than {column} holds on MariaDB/MySQL \
             ({chars} characters): {fix}"
        )));
    }
    Ok(())
}

/// A (message, handler) pair of a batch: their indexes, the route and the message.
type Pair<'b, 'm> = (usize, usize, &'b Route, &'b Incoming<'m>);

/// Handles the messages; see the module's docs. `in_place`: a retryable failure stops the batch
/// there (what came before commits). An error is the database's: nothing of the batch
/// committed. With a `fence`, every transaction checks first that the lease is still owned
/// (holding its fence row to its end), and fails with [`Unhandled::LeaseLost`] if it is not.
pub(crate) async fn handle(
    pool: &MySqlPool,
    routes: &Routes,
    messages: &[Checked<'_>],
    in_place: bool,
    fence: Option<&Fence<'_>>,
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
    let handled = passes(&mut session, &pairs, in_place, fence, outcome).await;
    session.restore().await;
    if handled.is_ok() && !pairs.is_empty() {
        // Its handlers may have emitted (`mysql::emit`): the relays of this process claim now,
        // as after a unit of work, rather than at their next poll.
        crate::mysql::wake::committed();
    }
    handled
}

/// The batch's passes on `session`: straight through, then, after a failure, with a
/// savepoint per handler until one commits.
async fn passes(
    session: &mut Session,
    pairs: &[Pair<'_, '_>],
    in_place: bool,
    fence: Option<&Fence<'_>>,
    outcome: impl Fn() -> Handled,
) -> std::result::Result<Handled, Unhandled> {
    let mut known = HashMap::new();
    match straight(session, pairs, fence, outcome()).await? {
        Straight::Done(outcome) => return Ok(outcome),
        Straight::Failed(Some((key, failure))) => {
            known.insert(key, failure);
        }
        Straight::Failed(None) => {}
    }
    loop {
        match pass(session, pairs, &known, in_place, fence, outcome()).await? {
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

/// The first pass: every handler straight in the transaction, behind the batch's savepoint (set
/// as it begins, released with its `COMMIT`: gone if the server rolled the transaction back
/// under a handler). The dedup rows of the pairs it ran are inserted with the commit, after
/// them: if a handler committed the transaction on its own (DDL, `COMMIT`, `LOCK TABLES`), what
/// it and those before it wrote committed without their rows, and they run again in the next
/// pass, rather than the pairs after it being recorded as handled without having run. Any
/// failure gives the pass up for [`pass`].
async fn straight(
    session: &mut Session,
    pairs: &[Pair<'_, '_>],
    fence: Option<&Fence<'_>>,
    mut outcome: Handled,
) -> std::result::Result<Straight, Unhandled> {
    let mut tx = Connection::begin_with(session.begin(), BEGIN_MARKED).await?;
    let candidates: Vec<(Uuid, &str)> = pairs
        .iter()
        .map(|(_, _, route, incoming)| (incoming.meta.event_id, route.key.as_str()))
        .collect();
    let mut new = unrecorded(&mut tx, &candidates, fence).await?;
    let mut ran = Vec::new();
    for &(i, h, route, incoming) in pairs {
        let pair = (incoming.meta.event_id, route.key.as_str());
        if !new.remove(&pair) {
            outcome.duplicates += 1;
            continue;
        }
        match call(route, incoming, &mut tx).await {
            Ok(()) => {
                outcome.processed += 1;
                ran.push(pair);
            }
            Err(failure) => {
                // A failure after the server rolled the transaction back (a deadlock another
                // handler swallowed) may be that rollback's doing (a row gone): not this
                // handler's to bear.
                let alive = run(&mut tx, "ROLLBACK TO SAVEPOINT _outbox_h").await;
                discard(tx).await;
                let ended = alive
                    .as_ref()
                    .is_err_and(|e| number(e) == Some(NO_SAVEPOINT));
                let known = !ended && !matches!(failure, Failure::Transaction(_));
                return Ok(Straight::Failed(known.then_some(((i, h), failure))));
            }
        }
    }
    let mut commit = String::new();
    if !ran.is_empty() {
        push_insert(&mut commit, &ran);
        commit.push_str("; ");
    }
    commit.push_str("RELEASE SAVEPOINT _outbox_h; COMMIT");
    match run(&mut tx, &commit).await {
        Ok(()) => Ok(Straight::Done(outcome)),
        Err(e) => {
            discard(tx).await;
            match number(&e) {
                Some(NO_SAVEPOINT) => {
                    tracing::debug!("a batch's transaction ended under a handler; finding which");
                    Ok(Straight::Failed(None))
                }
                // Another consumer recorded a pair since the read: the next pass reads again.
                Some(DUPLICATE_KEY) => Ok(Straight::Failed(None)),
                _ => Err(e.into()),
            }
        }
    }
}

/// What became of one pass over a batch.
enum Pass {
    Done(Handled),
    /// The transaction ended (or was given up after a panic) at pair `(message, handler)`,
    /// which failed so: start over with it known.
    Again((usize, usize), Failure),
}

/// A pass after a failure: the pairs in one transaction, each behind a savepoint of its own,
/// its dedup row inserted in the round trip that sets it (so that a handler's rollback takes
/// its row too, and a transaction a handler committed on its own holds the rows of the pairs
/// that ran, no others); `known` failures not run again.
async fn pass(
    session: &mut Session,
    pairs: &[Pair<'_, '_>],
    known: &HashMap<(usize, usize), Failure>,
    in_place: bool,
    fence: Option<&Fence<'_>>,
    mut outcome: Handled,
) -> std::result::Result<Pass, Unhandled> {
    let mut tx = Connection::begin_with(session.begin(), BEGIN).await?;
    let candidates: Vec<(Uuid, &str)> = pairs
        .iter()
        .filter(|(i, h, ..)| !known.contains_key(&(*i, *h)))
        .map(|(_, _, route, incoming)| (incoming.meta.event_id, route.key.as_str()))
        .collect();
    let mut new = unrecorded(&mut tx, &candidates, fence).await?;
    // The handler that ran last returned `Ok` behind the savepoint, not yet released: the
    // release says whether the transaction is still there.
    let mut unreleased: Option<((usize, usize), &Route)> = None;
    for &(i, h, route, incoming) in pairs {
        let pair = (incoming.meta.event_id, route.key.as_str());
        let failure = if let Some(failure) = known.get(&(i, h)) {
            failure.clone()
        } else if !new.remove(&pair) {
            outcome.duplicates += 1;
            continue;
        } else {
            let mut step = String::new();
            if unreleased.is_some() {
                step.push_str("RELEASE SAVEPOINT _outbox_h; ");
            }
            let _ = write!(step, "{SAVEPOINT}; ");
            push_insert(&mut step, &[pair]);
            let stepped = run(&mut tx, &step).await;
            let before = unreleased.take();
            if let Err(e) = stepped {
                match (number(&e), before) {
                    (Some(NO_SAVEPOINT), Some((key, before))) => {
                        return lost(tx, e, key, before).await
                    }
                    // Another consumer recorded it since the read: a duplicate now (the
                    // savepoint is set; the failed insert undid only itself).
                    (Some(DUPLICATE_KEY), _) => {
                        outcome.duplicates += 1;
                        continue;
                    }
                    _ => {
                        discard(tx).await;
                        return Err(e.into());
                    }
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
                    // Undoes its work and its dedup row.
                    if let Err(e) = run(&mut tx, "ROLLBACK TO SAVEPOINT _outbox_h").await {
                        discard(tx).await;
                        if number(&e) != Some(NO_SAVEPOINT) {
                            return Err(e.into());
                        }
                        // The transaction ended under this handler: what it reported may be
                        // that ending's doing (a row gone), and is retried as such.
                        let failure = match failure {
                            Failure::Transaction(_) => failure,
                            _ => ended_under(route),
                        };
                        return Ok(Pass::Again((i, h), failure));
                    }
                    failure
                }
            }
        };
        if in_place && !failure.is_permanent() {
            outcome.stop_at(i, failure);
            break;
        }
        outcome.fail(i, failure);
    }
    let commit = if unreleased.is_some() {
        "RELEASE SAVEPOINT _outbox_h; COMMIT"
    } else {
        "COMMIT"
    };
    match run(&mut tx, commit).await {
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
    Ok(Pass::Again(key, ended_under(before)))
}

/// The failure of handler `route` under which the transaction ended: rolled back by the server
/// (a deadlock or lock wait timeout whose error it caught), or committed on its own (DDL,
/// `COMMIT`, `LOCK TABLES`, `SET autocommit = 1`).
fn ended_under(route: &Route) -> Failure {
    Failure::Retryable(format!(
        "handler `{}` returned, but its transaction had ended under it: rolled back by the \
         server (a deadlock or a lock wait timeout whose error it caught: let such an error \
         end the handler, `?`), or committed by a statement that commits on its own (DDL, \
         COMMIT, LOCK TABLES: not in a handler)",
        route.handler.name()
    ))
}

/// The pairs of `candidates` that `processed_event` does not hold (each once), read as a
/// transaction begins: with a `fence`, first (in the same round trip) its check, which holds
/// the lease's fence row to the transaction's end; [`Unhandled::LeaseLost`] if another
/// instance owns the lease (the caller's transaction is rolled back as it drops).
async fn unrecorded<'k>(
    conn: &mut MySqlConnection,
    candidates: &[(Uuid, &'k str)],
    fence: Option<&Fence<'_>>,
) -> std::result::Result<HashSet<(Uuid, &'k str)>, Unhandled> {
    let mut ids: Vec<Uuid> = candidates.iter().map(|(id, _)| *id).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut select = String::new();
    if let Some(f) = fence {
        crate::store::lease_mysql::owned_sql(&mut select, f.group, f.topic, f.holder);
        select.push_str("; ");
    }
    if !ids.is_empty() {
        select.push_str(
            "SELECT event_id, CAST(handler AS CHAR) FROM processed_event WHERE event_id IN (",
        );
        for (n, id) in ids.iter().enumerate() {
            select.push_str(if n == 0 { "X'" } else { ", X'" });
            push_hex(&mut select, id.as_bytes());
            select.push('\'');
        }
        select.push(')');
    }
    if select.is_empty() {
        return Ok(HashSet::new());
    }
    let mut rows = conn.fetch_all(sqlx::raw_sql(&select)).await?.into_iter();
    if fence.is_some() {
        // The fence's statement returns one row, first.
        let owned: i64 = rows.next().map_or(Ok(0), |row| row.try_get(0))?;
        if owned == 0 {
            return Err(Unhandled::LeaseLost);
        }
    }
    let seen: HashSet<(Uuid, String)> = rows
        .map(|row| Ok((row.try_get::<Uuid, _>(0)?, row.try_get::<String, _>(1)?)))
        .collect::<std::result::Result<_, sqlx::Error>>()?;
    Ok(candidates
        .iter()
        .filter(|(id, key)| !seen.contains(&(*id, (*key).to_owned())))
        .copied()
        .collect())
}

/// Appends the `INSERT` of `pairs`' dedup rows, in key order (so that two batches of the same
/// messages wait for each other rather than deadlock).
fn push_insert(sql: &mut String, pairs: &[(Uuid, &str)]) {
    let mut pairs = pairs.to_vec();
    pairs.sort_unstable();
    sql.push_str("INSERT INTO processed_event (event_id, handler, processed_at) VALUES ");
    for (n, (id, key)) in pairs.iter().enumerate() {
        sql.push_str(if n == 0 { "(X'" } else { ", (X'" });
        push_hex(sql, id.as_bytes());
        sql.push_str("', ");
        push_text(sql, key);
        sql.push_str(", UTC_TIMESTAMP(6))");
    }
}

/// Begins a batch: autocommit off for it, so that what a handler writes after the server rolled
/// the transaction back (a deadlock it caught) does not commit on its own but waits in an
/// implicit transaction, rolled back when the batch finds its savepoint gone; and
/// `@outbox_consumer_batch` set, which tells `mysql::emit` in a handler that the batch checks
/// its transaction itself. Then READ COMMITTED for this transaction.
const BEGIN: &str = "SET autocommit = 0, @outbox_consumer_batch = 1; \
                     SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// [`BEGIN`], then the batch's savepoint (the straight pass's).
const BEGIN_MARKED: &str = "SET autocommit = 0, @outbox_consumer_batch = 1; \
                            SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION; \
                            SAVEPOINT _outbox_h";

/// The session as the pool gave it, once the batch is done.
/// Rolls back first: `SET autocommit = 1` would commit a transaction still open.
const RESTORE: &str = "ROLLBACK; SET autocommit = 1, @outbox_consumer_batch = NULL";

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
