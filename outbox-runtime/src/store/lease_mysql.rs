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

use sqlx::{Connection, MySqlPool};
use uuid::Uuid;

use super::lease::Acquired;
use crate::error::Result;

/// Takes `group`'s lease on `topic` for `holder`, for `length` from now by the database's
/// clock, if it is free, released, expired or already `holder`'s; `None` if another instance
/// owns it, or a batch of its holder runs (its fence row is locked).
pub(crate) async fn try_acquire(
    pool: &MySqlPool,
    group: &str,
    topic: &str,
    holder: Uuid,
    length: Duration,
) -> Result<Option<Acquired>> {
    let mut conn = pool.acquire().await?;
    // The rows, each in a statement of its own: the duplicate key check of an existing one
    // holds its shared lock only for the statement (held to the end of a transaction, two
    // instances' shared locks would each keep the other from the exclusive one below).
    for table in ["outbox_consumer_lease", "outbox_consumer_fence"] {
        let columns = if table == "outbox_consumer_lease" {
            "(group_id, topic, expires_at) VALUES (?, ?, UTC_TIMESTAMP(6))"
        } else {
            "(group_id, topic) VALUES (?, ?)"
        };
        sqlx::query(&format!("INSERT IGNORE INTO {table} {columns}"))
            .bind(group)
            .bind(topic)
            .execute(&mut *conn)
            .await?;
    }
    sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(&mut *conn)
        .await?;
    let mut tx = conn.begin().await?;
    // A batch of the holder has the fence row (a shared lock): the lease is in use, and
    // waiting for the batch would hold this connection for as long as it runs.
    let fence: Option<Option<Uuid>> = sqlx::query_scalar(
        "SELECT holder FROM outbox_consumer_fence WHERE group_id = ? AND topic = ? \
         FOR UPDATE SKIP LOCKED",
    )
    .bind(group)
    .bind(topic)
    .fetch_optional(&mut *tx)
    .await?;
    if fence.is_none() {
        return Ok(None);
    }
    let (current, expired): (Option<Uuid>, bool) = sqlx::query_as(
        "SELECT holder, expires_at <= UTC_TIMESTAMP(6) FROM outbox_consumer_lease \
         WHERE group_id = ? AND topic = ? FOR UPDATE",
    )
    .bind(group)
    .bind(topic)
    .fetch_one(&mut *tx)
    .await?;
    let acquired = match current {
        None => Acquired::Free,
        Some(current) if current == holder => Acquired::Free,
        Some(_) if expired => Acquired::TakenOver,
        Some(_) => return Ok(None),
    };
    sqlx::query(
        "UPDATE outbox_consumer_lease \
         SET holder = ?, expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
         WHERE group_id = ? AND topic = ?",
    )
    .bind(holder)
    .bind(micros(length))
    .bind(group)
    .bind(topic)
    .execute(&mut *tx)
    .await?;
    sqlx::query("UPDATE outbox_consumer_fence SET holder = ? WHERE group_id = ? AND topic = ?")
        .bind(holder)
        .bind(group)
        .bind(topic)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Some(acquired))
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
    sql.push_str("SELECT COUNT(*) FROM outbox_consumer_fence WHERE group_id = ");
    super::literal_mysql::push_text(sql, group);
    sql.push_str(" AND topic = ");
    super::literal_mysql::push_text(sql, topic);
    sql.push_str(" AND holder = X'");
    super::literal_mysql::push_hex(sql, holder.as_bytes());
    sql.push_str("' LOCK IN SHARE MODE");
}

/// `length` in microseconds, for `INTERVAL ? MICROSECOND`.
fn micros(length: Duration) -> i64 {
    i64::try_from(length.as_micros()).unwrap_or(i64::MAX)
}
