//! Dedup mode on MariaDB and MySQL: a batch of messages, their `processed_event` rows and their
//! handlers in one transaction, one commit whatever the handlers' faults.
//!
//! The core (`inbox/dedup.rs`) and the brokers are shared with PostgreSQL; this is the
//! database's part, the twin of `inbox/batch.rs` (SQL and all: the MySQL relay's split of loop
//! and statements would be two small files here), shaped by what InnoDB does differently:
//!
//! - **A failed statement undoes itself only**, not the transaction (PostgreSQL aborts it), so a
//!   savepoint per handler is cheap and needs no ladder: each handler runs behind
//!   `SAVEPOINT _outbox_h`, set in the round trip that releases the one before; a handler that
//!   fails is rolled back to it (and its dedup row deleted) in one round trip, and the batch goes
//!   on. A batch is so one transaction and one commit, with one round trip per handler beyond
//!   its own statements.
//! - **A deadlock rolls the whole transaction back** and the session goes on in autocommit. The
//!   release of a handler's savepoint (or the rollback to it) fails then (1305, no such
//!   savepoint), which says the transaction is gone: the pass starts over in a new transaction,
//!   that handler's failure known (not run again: it goes to its retry). A handler that caught
//!   the deadlock and returned `Ok` is found the same way; what it wrote after the catch
//!   committed on its own, which no database-side check can undo: return the error (`?`).
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
    let mut known = HashMap::new();
    loop {
        let mut outcome = Handled::new(messages.len());
        for (i, failure) in &bad {
            outcome.fail(*i, failure.clone());
        }
        match pass(pool, &pairs, &known, in_place, outcome).await? {
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

/// What became of one pass over a batch.
enum Pass {
    Done(Handled),
    /// The transaction was lost (or given up after a panic) at pair `(message, handler)`,
    /// which failed so: start over with it known.
    Again((usize, usize), Failure),
}

/// One pass: the pairs in one transaction, a savepoint each; `known` failures not run again.
async fn pass(
    pool: &MySqlPool,
    pairs: &[Pair<'_, '_>],
    known: &HashMap<(usize, usize), Failure>,
    in_place: bool,
    mut outcome: Handled,
) -> std::result::Result<Pass, Unhandled> {
    let mut conn = pool.acquire().await?;
    let mut tx = Connection::begin_with(
        &mut *conn,
        "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION",
    )
    .await?;
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
            let span = super::meta::parented(
                tracing::info_span!("outbox_consume", event_id = %meta.event_id,
                    handler = route.handler.name()),
                meta,
            );
            let result = route
                .handle(incoming.payload, Conn::MySql(&mut tx), meta)
                .instrument(span)
                .await;
            match result {
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
