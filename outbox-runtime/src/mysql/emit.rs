//! Writing outbox rows on MariaDB and MySQL, and the checked commit.
//!
//! Each round trip is one text query of several statements (the protocol's multi-statements;
//! the server stops at the first that fails). The first of a write is the probe and the key
//! locks:
//!
//! - **the probe**, `SAVEPOINT _outbox_write; RELEASE SAVEPOINT _outbox_write`: inside a
//!   transaction both succeed; outside one the savepoint ends with its own autocommitted
//!   statement and the release fails (1305). InnoDB rolls a deadlocked transaction back whole and
//!   the session goes on in autocommit, so without the probe rows written after a caught
//!   deadlock would commit alone, and `COMMIT` would "succeed". MariaDB's `@@in_transaction`
//!   says the same, but MySQL has no such variable: the probe works on both, with no privilege.
//!   With `autocommit=0` the statement after such a rollback silently begins a new transaction,
//!   and no probe could tell: such a session is refused (a constant subquery of two rows when
//!   `@@autocommit = 0`, error 1242, in the key locks' statement).
//! - **a savepoint** (a write, not a commit), `SAVEPOINT _outbox_write`, released after the last
//!   insert: a write that fails part way (a later round trip, a later statement) is rolled back
//!   to it, so an application that goes on after the error commits none of its rows, as on
//!   PostgreSQL where the write is one statement. A commit that fails rolls back whole.
//! - **the key locks**, `SELECT ... FROM outbox_key_lock WHERE bucket IN (...) FOR UPDATE`: every
//!   bucket of every row at once, before any insert, held to the commit. One statement locks in
//!   index order, so two writers never deadlock on them, and a key's next transaction takes its
//!   `AUTO_INCREMENT` ids only after this one commits: per key, `id` order is commit order.
//!
//! A unit of work's commit is so one round trip of five statements (probe, locks, insert,
//! `COMMIT`) after its own; the hand-written floor (one prepared `INSERT`, then `COMMIT`) takes
//! one round trip more and three statements fewer (BENCHMARKS.md).
//!
//! Values go as literals: numbers as digits, text as `_utf8mb4 X'..'` (exact whatever
//! `sql_mode` says about backslashes), so no statement is prepared per row count.

use std::borrow::Cow;
use std::fmt::Write as _;

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{Executor, MySql, MySqlConnection, Transaction};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::event::OutboxRecord;
use crate::sqlstate::DbError;
use crate::store::literal_mysql::{push_hex, push_text};
use crate::uow::{event_types, is_outermost, EmitDatabase, EmitFuture};

/// The probe: its second statement fails (1305) unless the session is inside a transaction.
const PROBE: &str = "SAVEPOINT _outbox_write; RELEASE SAVEPOINT _outbox_write; ";
/// Statements in [`PROBE`].
const PROBE_STATEMENTS: usize = 2;
/// One when `autocommit` is on; two rows, so an error (1242) where a scalar is expected, when
/// it is off. Part of the key locks' statement (a constant, evaluated before any row is
/// locked), or a statement of its own when there are no rows.
/// A consumer's batch (`inbox/batch_mysql.rs`) runs with autocommit off and checks its
/// transaction itself; it says so in `@outbox_consumer_batch`, and a handler's emit is let be.
const AUTOCOMMIT_ON: &str = "(SELECT 1 UNION ALL SELECT 1 FROM DUAL \
                             WHERE @@autocommit = 0 AND @outbox_consumer_batch IS NULL)";
/// The savepoint a write (not a commit: a failed commit rolls back whole) undoes itself to.
const SAVEPOINT: &str = "SAVEPOINT _outbox_write; ";
/// A subquery that returned more than one row: the probe's refusal of `autocommit=0`.
const MORE_THAN_ONE_ROW: u16 = 1242;
/// A write that failed part way undoes what it did.
const UNDO: &str = "ROLLBACK TO SAVEPOINT _outbox_write";
/// A write that succeeded lets its savepoint go.
const RELEASE: &str = "RELEASE SAVEPOINT _outbox_write";
/// MySQL's and MariaDB's error number for a savepoint that does not exist.
const NO_SAVEPOINT: u16 = 1305;
/// A round trip's text stays under this (the servers' `max_allowed_packet` is 16 MiB on
/// MariaDB and 64 MiB on MySQL by default); a bigger write takes several.
const ROUND_TRIP_BYTES: usize = 4 << 20;
/// A row's text at most (its payload, headers, ids), refused at emit beyond: hex-encoded, a
/// round trip of it alone stays under MariaDB's default `max_allowed_packet` (16 MiB), which a
/// bigger one would exceed (the server then drops the connection).
const MAX_ROW_TEXT_BYTES: usize = 7 << 20;
/// `VARCHAR(255)` columns: `aggregate_type`, `event_type`, `topic` (characters).
const VARCHAR_CHARS: usize = 255;
/// `TEXT` columns: `aggregate_id`, `partition_key` (bytes).
const TEXT_BYTES: usize = 65_535;

const INSERT: &str = "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, \
                      event_type, payload, headers, topic, partition_key, key_bucket, created_at) \
                      VALUES ";

/// The bucket of `outbox_key_lock` a partition key locks: the low 16 bits of the CRC-32 of its
/// UTF-8 bytes, `CRC32(key) & 65535` in SQL, so that another writer can take the same lock.
pub(crate) fn key_bucket(key: &str) -> u16 {
    (crc32(key.as_bytes()) & 0xFFFF) as u16
}

/// CRC-32 (ISO 3309, zlib's and the SQL function's), bit by bit: keys are short.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// What a round trip ends with.
#[derive(Clone, Copy, PartialEq)]
enum End {
    /// Nothing: the rows stay in the transaction.
    Write,
    /// `COMMIT`.
    Commit,
}

/// One round trip: its text and how many statements it holds.
struct Script {
    sql: String,
    statements: usize,
}

/// The round trips that write `records` (the first with the probe and every key lock), the last
/// ending with `end`.
fn scripts(records: &[OutboxRecord], end: End) -> Vec<Script> {
    let mut first = Script {
        sql: String::from(PROBE),
        statements: PROBE_STATEMENTS,
    };
    if end == End::Write {
        first.sql.push_str(SAVEPOINT);
        first.statements += 1;
    }
    if records.is_empty() {
        let _ = write!(first.sql, "SELECT {AUTOCOMMIT_ON}; ");
        first.statements += 1;
    } else {
        let mut buckets: Vec<u16> = records
            .iter()
            .map(|r| key_bucket(r.partition_key()))
            .collect();
        buckets.sort_unstable();
        buckets.dedup();
        first
            .sql
            .push_str("SELECT bucket FROM outbox_key_lock WHERE bucket IN (");
        push_list(&mut first.sql, buckets.iter());
        let _ = write!(first.sql, ") AND {AUTOCOMMIT_ON} = 1 FOR UPDATE; ");
        first.statements += 1;
    }
    let mut scripts = vec![first];
    // Rows go into INSERTs; a row that would take the round trip past its size starts the
    // next one (a row alone may be bigger: at most `MAX_ROW_TEXT_BYTES`, hex-encoded).
    let mut open_insert = false;
    for r in records {
        let script = scripts.last_mut().expect("at least the first");
        if open_insert && script.sql.len() + literal_size(r) > ROUND_TRIP_BYTES {
            script.sql.push_str("; ");
            scripts.push(Script {
                sql: String::new(),
                statements: 0,
            });
            open_insert = false;
        }
        let script = scripts.last_mut().expect("at least the first");
        if open_insert {
            script.sql.push_str(", ");
        } else {
            script.sql.push_str(INSERT);
            script.statements += 1;
            open_insert = true;
        }
        push_row(&mut script.sql, r);
    }
    let last = scripts.last_mut().expect("at least the first");
    if open_insert {
        last.sql.push_str("; ");
    }
    last.sql.push_str(match end {
        End::Write => RELEASE,
        End::Commit => "COMMIT",
    });
    last.statements += 1;
    scripts
}

/// Refuses what the columns cannot hold (a non-strict `sql_mode` would cut it short silently).
/// A unit of work checks each row as it is emitted; the emit functions before they write.
fn check_limits(r: &OutboxRecord) -> Result<()> {
    let too_long = |what: &str, limit: String| Error::InvalidEvent {
        event_type: r.event_type.clone(),
        reason: format!("its {what} is longer than the MySQL outbox column holds ({limit})").into(),
    };
    for (what, value) in [
        ("aggregate type", r.aggregate_type()),
        ("event type", r.event_type()),
        ("topic", r.topic()),
    ] {
        if value.chars().count() > VARCHAR_CHARS {
            return Err(too_long(what, format!("{VARCHAR_CHARS} characters")));
        }
    }
    for (what, value) in [
        ("aggregate id", r.aggregate_id()),
        ("partition key", r.partition_key()),
    ] {
        if value.len() > TEXT_BYTES {
            return Err(too_long(what, format!("{TEXT_BYTES} bytes")));
        }
    }
    if text_bytes(r) > MAX_ROW_TEXT_BYTES {
        return Err(Error::InvalidEvent {
            event_type: r.event_type.clone(),
            reason: format!(
                "its payload and headers take {} bytes; the MySQL outbox writes at most \
                 {MAX_ROW_TEXT_BYTES} bytes per event (within MariaDB's default \
                 max_allowed_packet)",
                text_bytes(r)
            )
            .into(),
        });
    }
    Ok(())
}

fn push_list<T: std::fmt::Display>(sql: &mut String, items: impl Iterator<Item = T>) {
    for (i, item) in items.enumerate() {
        if i > 0 {
            sql.push_str(", ");
        }
        let _ = write!(sql, "{item}");
    }
}

/// The bytes of a row's text.
fn text_bytes(r: &OutboxRecord) -> usize {
    let headers = if r.has_stored_headers() {
        r.headers_json().len()
    } else {
        0
    };
    r.aggregate_type().len()
        + r.aggregate_id().len()
        + r.event_type().len()
        + r.payload().len()
        + headers
        + r.topic().len()
        + r.partition_key().len()
}

/// About how long a row's literal is (hex doubles its text).
fn literal_size(r: &OutboxRecord) -> usize {
    2 * text_bytes(r) + 200
}

fn push_row(sql: &mut String, r: &OutboxRecord) {
    sql.push_str("(X'");
    push_hex(sql, r.event_id.as_bytes());
    sql.push('\'');
    for value in [
        r.aggregate_type(),
        r.aggregate_id(),
        r.event_type(),
        r.payload(),
    ] {
        sql.push_str(", ");
        push_text(sql, value);
    }
    sql.push_str(", ");
    if r.has_stored_headers() {
        push_text(sql, &r.headers_json());
    } else {
        sql.push_str("NULL");
    }
    for value in [r.topic(), r.partition_key()] {
        sql.push_str(", ");
        push_text(sql, value);
    }
    let _ = write!(
        sql,
        ", {}, UTC_TIMESTAMP(6))",
        key_bucket(r.partition_key())
    );
}

/// Where a round trip failed: how many of its statements had completed, and the error.
struct Failed {
    completed: usize,
    error: sqlx::Error,
}

/// Runs a round trip of several statements, counting those that completed.
async fn run(conn: &mut MySqlConnection, sql: &str) -> std::result::Result<(), Failed> {
    let mut results = conn.fetch_many(sqlx::raw_sql(sql));
    let mut completed = 0;
    loop {
        match std::future::poll_fn(|cx| results.as_mut().poll_next(cx)).await {
            None => return Ok(()),
            Some(Ok(sqlx::Either::Left(_))) => completed += 1,
            Some(Ok(sqlx::Either::Right(_))) => {}
            Some(Err(error)) => return Err(Failed { completed, error }),
        }
    }
}

/// What the probe found wrong, if it failed: the session not in a transaction, or in one that
/// `autocommit=0` would silently begin again after the server rolled it back.
fn probe_failed(failed: &Failed, event_types: Cow<'static, str>) -> Option<Error> {
    let sqlx::Error::Database(e) = &failed.error else {
        return None;
    };
    let number = e.try_downcast_ref::<MySqlDatabaseError>()?.number();
    match (failed.completed, number) {
        (1, NO_SAVEPOINT) => Some(Error::NotInTransaction { event_types }),
        (2 | 3, MORE_THAN_ONE_ROW) => Some(Error::Config(format!(
            "cannot write `{event_types}` to the outbox: the MySQL session has autocommit=0, \
             where a transaction the server rolled back (a deadlock) cannot be told from the \
             next one; use autocommit=1 (the default) and begin transactions explicitly"
        ))),
        _ => None,
    }
}

/// Writes `records` (and commits, with `End::Commit`), checked; see the module's docs.
async fn write(conn: &mut MySqlConnection, records: &[OutboxRecord], end: End) -> Result<()> {
    let event_types = || event_types(records);
    let scripts = scripts(records, end);
    let last = scripts.len() - 1;
    for (i, script) in scripts.iter().enumerate() {
        let Err(failed) = run(conn, &script.sql).await else {
            continue;
        };
        if i == 0 {
            if let Some(error) = probe_failed(&failed, event_types()) {
                return Err(error);
            }
        }
        if end == End::Write && (i > 0 || failed.completed > PROBE_STATEMENTS) {
            // Undo what the write did; after a deadlock the server rolled back everything, and
            // this fails harmlessly.
            if let Err(e) = conn.execute(sqlx::raw_sql(UNDO)).await {
                tracing::debug!(error = %crate::error_chain(&e), "cannot roll back a failed outbox write");
            }
        }
        return Err(match end {
            End::Write => Error::Emit {
                event_type: event_types(),
                source: failed.error,
            },
            // The last round trip went out whole and the server runs it all unless a statement
            // fails: a session lost on the way may have committed, whichever answer was lost.
            End::Commit if i == last && !matches!(failed.error, sqlx::Error::Database(_)) => {
                Error::CommitOutcomeUnknown {
                    event_types: event_types(),
                    source: failed.error,
                }
            }
            End::Commit if i == last && failed.completed + 1 == script.statements => {
                commit_failed(failed.error, event_types())
            }
            End::Commit => Error::Commit {
                event_types: event_types(),
                source: failed.error,
            },
        });
    }
    Ok(())
}

/// `COMMIT` itself failed: refused by the server (nothing written), or the session ended on
/// the way (the server shutting down, the connection killed: it may have committed).
fn commit_failed(source: sqlx::Error, event_types: Cow<'static, str>) -> Error {
    if DbError::of(&source) == DbError::Unavailable {
        Error::CommitOutcomeUnknown {
            event_types,
            source,
        }
    } else {
        Error::Commit {
            event_types,
            source,
        }
    }
}

impl EmitDatabase for MySql {
    fn check(record: &OutboxRecord) -> Result<()> {
        check_limits(record)
    }

    fn write<'a>(
        conn: &'a mut Self::Connection,
        records: &'a [OutboxRecord],
    ) -> EmitFuture<'a, Vec<Uuid>> {
        Box::pin(async move {
            if records.is_empty() {
                return Ok(Vec::new());
            }
            write(conn, records, End::Write).await?;
            Ok(records.iter().map(OutboxRecord::event_id).collect())
        })
    }

    fn commit(mut tx: Transaction<'_, Self>, pending: Vec<OutboxRecord>) -> EmitFuture<'_, ()> {
        Box::pin(async move {
            if is_outermost(&mut tx) {
                // The rows and COMMIT in one round trip (or the last of several). The dropped
                // `Transaction` then sends a `ROLLBACK`, which outside a transaction does nothing.
                let result = write(&mut tx, &pending, End::Commit).await;
                #[cfg(feature = "_broker")]
                if result.is_ok() {
                    super::wake::committed();
                }
                if result.as_ref().is_err_and(|e| !e.is_outcome_unknown()) {
                    // Release its locks now, not when the connection is next used.
                    if let Err(e) = tx.rollback().await {
                        tracing::debug!(error = %crate::error_chain(&e), "cannot roll back a failed transaction");
                    }
                }
                return result;
            }
            // A savepoint: the rows (or the probe alone), then released into its transaction,
            // which has not committed whatever happens here.
            let event_types = event_types(&pending);
            let not_committed = |source| Error::Commit {
                event_types: event_types.clone(),
                source,
            };
            write(&mut tx, &pending, End::Write)
                .await
                .map_err(|e| match e {
                    Error::Emit { source, .. } => not_committed(source),
                    e => e,
                })?;
            tx.commit().await.map_err(not_committed)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{crc32, key_bucket};

    #[test]
    fn crc32_is_zlibs() {
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(key_bucket("123456789"), 0x3926);
    }
}
