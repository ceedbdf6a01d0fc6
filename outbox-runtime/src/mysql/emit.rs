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
//! - **a savepoint**, `SAVEPOINT _outbox_write`, released after the last insert: a write that
//!   fails part way (a later round trip, a later statement) is rolled back to it, so an
//!   application that goes on after the error commits none of its rows, as on PostgreSQL where
//!   the write is one statement.
//! - **the key locks**, `SELECT ... FROM outbox_key_lock WHERE bucket IN (...) FOR UPDATE`: every
//!   bucket of every row at once, before any insert, held to the commit. One statement locks in
//!   index order, so two writers never deadlock on them, and a key's next transaction takes its
//!   `AUTO_INCREMENT` ids only after this one commits: per key, `id` order is commit order.
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
use crate::uow::{event_types, is_outermost, EmitDatabase, EmitFuture};

/// The probe (its second statement fails, 1305, unless the session is inside a transaction),
/// then the write's savepoint.
const PROBE: &str = "SAVEPOINT _outbox_write; RELEASE SAVEPOINT _outbox_write; \
                     SAVEPOINT _outbox_write; ";
/// Statements in [`PROBE`].
const PROBE_STATEMENTS: usize = 3;
/// A write that failed part way undoes what it did.
const UNDO: &str = "ROLLBACK TO SAVEPOINT _outbox_write";
/// A write that succeeded lets its savepoint go.
const RELEASE: &str = "RELEASE SAVEPOINT _outbox_write";
/// MySQL's and MariaDB's error number for a savepoint that does not exist.
const NO_SAVEPOINT: u16 = 1305;
/// A round trip's text stays under this (the servers' `max_allowed_packet` is 16 MiB on
/// MariaDB and 64 MiB on MySQL by default); a bigger write takes several.
const ROUND_TRIP_BYTES: usize = 4 << 20;
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
fn scripts(records: &[OutboxRecord], end: End) -> Result<Vec<Script>> {
    records.iter().try_for_each(check_limits)?;
    let mut first = Script {
        sql: String::from(PROBE),
        statements: PROBE_STATEMENTS,
    };
    if !records.is_empty() {
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
        first.sql.push_str(") FOR UPDATE; ");
        first.statements += 1;
    }
    let mut scripts = vec![first];
    let mut rows = records.iter().peekable();
    while rows.peek().is_some() {
        let script = scripts.last_mut().expect("at least the first");
        if script.sql.len() >= ROUND_TRIP_BYTES {
            scripts.push(Script {
                sql: String::new(),
                statements: 0,
            });
            continue;
        }
        // One INSERT, up to the round trip's size (at least one row).
        script.sql.push_str(INSERT);
        let mut first_row = true;
        while let Some(r) = rows.peek() {
            if !first_row && script.sql.len() + literal_size(r) > ROUND_TRIP_BYTES {
                break;
            }
            if !first_row {
                script.sql.push_str(", ");
            }
            push_row(&mut script.sql, r);
            first_row = false;
            rows.next();
        }
        script.sql.push_str("; ");
        script.statements += 1;
    }
    let last = scripts.last_mut().expect("at least the first");
    last.sql.push_str(match end {
        End::Write => RELEASE,
        End::Commit => "COMMIT",
    });
    last.statements += 1;
    Ok(scripts)
}

/// Refuses what the columns cannot hold (a non-strict `sql_mode` would cut it short silently).
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

/// About how long a row's literal is.
fn literal_size(r: &OutboxRecord) -> usize {
    let text = r.aggregate_type().len()
        + r.aggregate_id().len()
        + r.event_type().len()
        + r.payload().len()
        + r.topic().len()
        + r.partition_key().len();
    2 * text + 200
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

/// Text as a hexadecimal literal in utf8mb4: exact whatever `sql_mode` says.
fn push_text(sql: &mut String, value: &str) {
    sql.push_str("_utf8mb4 X'");
    push_hex(sql, value.as_bytes());
    sql.push('\'');
}

fn push_hex(sql: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    sql.reserve(2 * bytes.len());
    for &b in bytes {
        sql.push(char::from(DIGITS[usize::from(b >> 4)]));
        sql.push(char::from(DIGITS[usize::from(b & 0xF)]));
    }
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

/// Whether the probe failed: the session was not in a transaction.
fn probe_failed(failed: &Failed) -> bool {
    failed.completed < 2
        && matches!(&failed.error, sqlx::Error::Database(e)
            if e.try_downcast_ref::<MySqlDatabaseError>().is_some_and(|e| e.number() == NO_SAVEPOINT))
}

/// Writes `records` (and commits, with `End::Commit`), checked; see the module's docs.
async fn write(conn: &mut MySqlConnection, records: &[OutboxRecord], end: End) -> Result<()> {
    let event_types = || event_types(records);
    let scripts = scripts(records, end)?;
    let last = scripts.len() - 1;
    for (i, script) in scripts.iter().enumerate() {
        let Err(failed) = run(conn, &script.sql).await else {
            continue;
        };
        if i == 0 && probe_failed(&failed) {
            return Err(Error::NotInTransaction {
                event_types: event_types(),
            });
        }
        if end == End::Write && (i > 0 || failed.completed >= PROBE_STATEMENTS) {
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

/// `COMMIT` itself failed: refused by the server (nothing written), or the session lost on the
/// way (it may have committed).
fn commit_failed(source: sqlx::Error, event_types: Cow<'static, str>) -> Error {
    match source {
        sqlx::Error::Database(_) => Error::Commit {
            event_types,
            source,
        },
        source => Error::CommitOutcomeUnknown {
            event_types,
            source,
        },
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
                return write(&mut tx, &pending, End::Commit).await;
            }
            // A savepoint: the rows (or the probe alone), then released into its transaction.
            write(&mut tx, &pending, End::Write)
                .await
                .map_err(|e| match e {
                    Error::Emit { event_type, source } => Error::Commit {
                        event_types: event_type,
                        source,
                    },
                    e => e,
                })?;
            let event_types = event_types(&pending);
            tx.commit().await.map_err(|e| commit_failed(e, event_types))
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
