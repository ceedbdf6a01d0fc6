//! The JetStream consumers' leases' SQL (`outbox_consumer_lease`, a row per group and topic):
//! taking a lease, renewing it, giving it up, and the check every dedup batch transaction makes
//! that it still owns it. When to do each (and for how long a lease counts as owned) is
//! `inbox/lease.rs`'s.

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use crate::error::Result;

/// How a lease was taken ([`try_acquire`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Acquired {
    /// It was free (never owned, released) or already this instance's.
    Free,
    /// Another instance owned it and let it expire (a crash, a stall): its unsettled messages
    /// are still pending on the server.
    TakenOver,
}

/// Takes `group`'s lease on `topic` for `holder`, for `length` from now by the database's
/// clock, if it is free, released, expired or already `holder`'s; `None` if another instance
/// owns it. One transaction: inserts the lease's row if it has none, locks it
/// (`FOR UPDATE SKIP LOCKED`), reads its holder and whether it expired, and writes `holder`
/// and `expires_at`.
#[allow(dead_code)] // by the brokers that read under a lease (JetStream)
pub(crate) async fn try_acquire(
    pool: &PgPool,
    group: &str,
    topic: &str,
    holder: Uuid,
    length: Duration,
) -> Result<Option<Acquired>> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO outbox_consumer_lease (group_id, topic) VALUES ($1, $2) \
         ON CONFLICT DO NOTHING",
    )
    .bind(group)
    .bind(topic)
    .execute(&mut *tx)
    .await?;
    // A batch transaction of the holder has the row (`FOR KEY SHARE`): it is owned, and
    // waiting for it would queue the holder's renewals behind this.
    let row: Option<(Option<Uuid>, bool)> = sqlx::query_as(
        "SELECT holder, expires_at <= clock_timestamp() FROM outbox_consumer_lease \
         WHERE group_id = $1 AND topic = $2 FOR UPDATE SKIP LOCKED",
    )
    .bind(group)
    .bind(topic)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((current, expired)) = row else {
        return Ok(None);
    };
    let acquired = match current {
        None => Acquired::Free,
        Some(current) if current == holder => Acquired::Free,
        Some(_) if expired => Acquired::TakenOver,
        Some(_) => return Ok(None),
    };
    sqlx::query(
        "UPDATE outbox_consumer_lease \
         SET holder = $3, expires_at = clock_timestamp() + $4 * interval '1 millisecond' \
         WHERE group_id = $1 AND topic = $2",
    )
    .bind(group)
    .bind(topic)
    .bind(holder)
    .bind(length.as_millis() as f64)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Some(acquired))
}

/// Moves the lease's `expires_at` to `length` from now (the database's clock) if `holder`
/// still owns it, expired or not; `false` if another instance has it.
#[allow(dead_code)] // by the brokers that read under a lease (JetStream)
pub(crate) async fn renew(
    pool: &PgPool,
    group: &str,
    topic: &str,
    holder: Uuid,
    length: Duration,
) -> Result<bool> {
    let renewed = sqlx::query(
        "UPDATE outbox_consumer_lease \
         SET expires_at = clock_timestamp() + $4 * interval '1 millisecond' \
         WHERE group_id = $1 AND topic = $2 AND holder = $3",
    )
    .bind(group)
    .bind(topic)
    .bind(holder)
    .bind(length.as_millis() as f64)
    .execute(pool)
    .await?;
    Ok(renewed.rows_affected() == 1)
}

/// Clears the lease's owner (its `holder` column) and expires it now, if `holder` owns it.
#[allow(dead_code)] // by the brokers that read under a lease (JetStream)
pub(crate) async fn release(pool: &PgPool, group: &str, topic: &str, holder: Uuid) -> Result<()> {
    sqlx::query(
        "UPDATE outbox_consumer_lease SET holder = NULL, expires_at = clock_timestamp() \
         WHERE group_id = $1 AND topic = $2 AND holder = $3",
    )
    .bind(group)
    .bind(topic)
    .bind(holder)
    .execute(pool)
    .await?;
    Ok(())
}

/// The fence: a row if `$3` owns the lease of group `$1` on topic `$2` and it has not expired.
/// Reads the lease's row `FOR KEY SHARE`, so that no instance takes the lease over (`FOR
/// UPDATE`) before the transaction ends, while its holder still renews it (an update of no key
/// column). A macro, so that a batch's first statement can hold it (see
/// [`dedup::lock_sources`](super::dedup::lock_sources)).
macro_rules! owned_sql {
    () => {
        "SELECT 1 FROM outbox_consumer_lease \
         WHERE group_id = $1 AND topic = $2 AND holder = $3 \
           AND expires_at > clock_timestamp() \
         FOR KEY SHARE"
    };
}
pub(crate) use owned_sql;
