//! The JetStream consumers' leases' SQL on MariaDB/MySQL: the twin of `store/lease.rs`, on two
//! rows per group and topic rather than one, because InnoDB's shared row lock conflicts with
//! every update of the row (PostgreSQL's `FOR KEY SHARE` lets the renewals through):
//!
//! - `outbox_consumer_lease` holds the lease's holder and time, which taking, renewing and
//!   giving the lease up write. No batch locks it.
//! - `outbox_consumer_fence` names the holder too, and is written only when the lease changes
//!   hands. Every batch transaction reads it first with a shared lock
//!   ([`owned_sql`]): a takeover (`FOR UPDATE SKIP LOCKED`) finds it locked while a batch of the
//!   holder runs, however long, and leaves the lease to the holder; once it changed hands, the
//!   former holder's next batch finds another name and commits nothing.
//!
//! The tables are the migration `mysql/20261207000005_consumer_lease.sql`'s.

use std::time::Duration;

use std::fmt::Write as _;

use sqlx::{Connection, Executor, MySqlPool, Row};
use uuid::Uuid;

use super::lease::Acquired;
use super::literal_mysql::{push_hex, push_text};
use crate::error::Result;

/// Takes `group`'s lease on `topic` for `holder`, for `length` from now by the database's
/// clock, if it is free, released, expired or already `holder`'s; `None` if another instance
/// owns it, or a batch of its holder runs (its fence row is locked).
///
/// A standby asks every third of the lease's length: a lease another instance owns is seen
/// without a lock, so that its holder's batches and renewals never wait for a standby. Only a
/// lease free to take is locked, for two round trips (both rows; then both writes and the
/// commit in one).
pub(crate) async fn try_acquire(
    pool: &MySqlPool,
    group: &str,
    topic: &str,
    holder: Uuid,
    length: Duration,
) -> Result<Option<Acquired>> {
    let mut conn = pool.acquire().await?;
    let seen: Option<(Option<Uuid>, bool)> = sqlx::query_as(
        "SELECT holder, expires_at <= UTC_TIMESTAMP(6) FROM outbox_consumer_lease \
         WHERE group_id = ? AND topic = ?",
    )
    .bind(group)
    .bind(topic)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some((Some(other), false)) = seen {
        if other != holder {
            return Ok(None);
        }
    }
    // The rows, each in a statement of its own: the duplicate key check of an existing one
    // holds its shared lock only for the statement (held to the end of a transaction, two
    // instances' shared locks would each keep the other from the exclusive one below).
    // `INSERT IGNORE`, not `ON DUPLICATE KEY UPDATE`, whose exclusive lock would wait for a
    // holder's batch; nothing but a duplicate can be ignored here (`build` refuses a group or
    // topic longer than the columns). The fence row even when the lease's exists: one deleted
    // by hand would otherwise leave the lease to no one, and the topic unread.
    let lease_row = "INSERT IGNORE INTO outbox_consumer_lease (group_id, topic, expires_at) \
                     VALUES (?, ?, UTC_TIMESTAMP(6))";
    let fence_row = "INSERT IGNORE INTO outbox_consumer_fence (group_id, topic) VALUES (?, ?)";
    let rows: &[&str] = if seen.is_some() {
        &[fence_row]
    } else {
        &[lease_row, fence_row]
    };
    for insert in rows {
        sqlx::query(insert)
            .bind(group)
            .bind(topic)
            .execute(&mut *conn)
            .await?;
    }
    let mut tx = Connection::begin_with(
        &mut *conn,
        "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION",
    )
    .await?;
    // A batch of the holder has the fence row (a shared lock): the lease is in use, and
    // waiting for the batch would hold this connection, and the lease's row, for as long as
    // it runs. The lease's row: its holder, and whether it expired.
    let mut read = String::from("SELECT holder FROM outbox_consumer_fence WHERE ");
    push_key(&mut read, group, topic);
    read.push_str(
        " FOR UPDATE SKIP LOCKED; \
         SELECT holder, expires_at <= UTC_TIMESTAMP(6) FROM outbox_consumer_lease WHERE ",
    );
    push_key(&mut read, group, topic);
    read.push_str(" FOR UPDATE");
    let rows = tx.fetch_all(sqlx::raw_sql(&read)).await?;
    let fence_free = rows.iter().any(|row| row.len() == 1);
    let lease: Option<(Option<Uuid>, bool)> = rows
        .iter()
        .find(|row| row.len() == 2)
        .map(|row| Ok::<_, sqlx::Error>((row.try_get(0)?, row.try_get(1)?)))
        .transpose()?;
    let acquired = match (fence_free, lease) {
        (true, Some((None, _))) => Some(Acquired::Free),
        (true, Some((Some(current), _))) if current == holder => Some(Acquired::Free),
        (true, Some((Some(_), true))) => Some(Acquired::TakenOver),
        _ => None,
    };
    let Some(acquired) = acquired else {
        tx.rollback().await?;
        return Ok(None);
    };
    let mut write = String::from("UPDATE outbox_consumer_lease SET holder = X'");
    push_hex(&mut write, holder.as_bytes());
    let _ = write!(
        write,
        "', expires_at = UTC_TIMESTAMP(6) + INTERVAL {} MICROSECOND WHERE ",
        micros(length)
    );
    push_key(&mut write, group, topic);
    write.push_str("; UPDATE outbox_consumer_fence SET holder = X'");
    push_hex(&mut write, holder.as_bytes());
    write.push_str("' WHERE ");
    push_key(&mut write, group, topic);
    write.push_str("; COMMIT");
    // The commit is in the round trip (what sqlx sends as `tx` drops, a rollback, then finds
    // no transaction).
    tx.execute(sqlx::raw_sql(&write)).await?;
    drop(tx);
    Ok(Some(acquired))
}

/// `group_id = <group> AND topic = <topic>`, as literals.
fn push_key(sql: &mut String, group: &str, topic: &str) {
    sql.push_str("group_id = ");
    push_text(sql, group);
    sql.push_str(" AND topic = ");
    push_text(sql, topic);
}

/// Moves the lease's `expires_at` to `length` from now (the database's clock) if `holder`
/// still owns it, expired or not; `false` if another instance has it.
pub(crate) async fn renew(
    pool: &MySqlPool,
    group: &str,
    topic: &str,
    holder: Uuid,
    length: Duration,
) -> Result<bool> {
    let renewed = sqlx::query(
        "UPDATE outbox_consumer_lease \
         SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
         WHERE group_id = ? AND topic = ? AND holder = ?",
    )
    .bind(micros(length))
    .bind(group)
    .bind(topic)
    .bind(holder)
    .execute(pool)
    .await?;
    Ok(renewed.rows_affected() == 1)
}

/// Clears the lease's owner and expires it now, if `holder` owns it. The fence row keeps its
/// name until another instance takes the lease (a released holder reads no more).
pub(crate) async fn release(
    pool: &MySqlPool,
    group: &str,
    topic: &str,
    holder: Uuid,
) -> Result<()> {
    sqlx::query(
        "UPDATE outbox_consumer_lease SET holder = NULL, expires_at = UTC_TIMESTAMP(6) \
         WHERE group_id = ? AND topic = ? AND holder = ?",
    )
    .bind(group)
    .bind(topic)
    .bind(holder)
    .execute(pool)
    .await?;
    Ok(())
}

/// The fence's check, as the first statement of a batch's round trip (its values written in,
/// for a multi-statement text query): one row, `1` if `holder` owns `group`'s lease on `topic`
/// (its fence row names it), else `0`. Reads the fence row with a shared lock, held to the
/// end of the batch's transaction, so that no instance takes the lease over meanwhile.
/// `LOCK IN SHARE MODE`: what MariaDB and MySQL both take (`FOR SHARE` is MySQL's only).
pub(crate) fn owned_sql(sql: &mut String, group: &str, topic: &str, holder: Uuid) {
    sql.push_str("SELECT COUNT(*) FROM outbox_consumer_fence WHERE ");
    push_key(sql, group, topic);
    sql.push_str(" AND holder = X'");
    push_hex(sql, holder.as_bytes());
    sql.push_str("' LOCK IN SHARE MODE");
}

/// `length` in microseconds, for `INTERVAL ? MICROSECOND`.
fn micros(length: Duration) -> i64 {
    i64::try_from(length.as_micros()).unwrap_or(i64::MAX)
}
