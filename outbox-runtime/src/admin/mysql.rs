//! The outbox's figures on MariaDB/MySQL, per topic, and the relay instances running: what
//! `outbox status` shows for a `mysql://` URL (`mysql::status`; its warnings: `mysql::health`,
//! in `health/mysql.rs`).

use sqlx::{MySqlConnection, MySqlPool, Row};

pub use super::health::mysql_health as health;
use crate::admin::{ConsumerLease, Status, TopicStatus};
use crate::error::Result;

/// Member slots of the relay instances: an instance's slot is one of `0..MEMBER_SLOTS` (the
/// first buckets of `outbox_key_lock` stand for them where they are counted).
pub(crate) const MEMBER_SLOTS: i32 = 256;

/// The named locks of this database's relays begin with this (a lock name is the server's,
/// across databases; at most 64 characters on MySQL).
pub(crate) const LOCK_PREFIX_SQL: &str = "CONCAT('outbox:r:', MD5(DATABASE()))";

const OUTBOX_SQL: &str = "\
SELECT CAST(topic AS CHAR), \
       CAST(COUNT(CASE WHEN published_at IS NULL AND parked_at IS NULL THEN 1 END) AS SIGNED), \
       CAST(COUNT(CASE WHEN published_at IS NULL AND parked_at IS NULL \
                        AND next_attempt_at IS NOT NULL THEN 1 END) AS SIGNED), \
       CAST(COUNT(CASE WHEN published_at IS NULL AND parked_at IS NULL \
                        AND held_at IS NOT NULL THEN 1 END) AS SIGNED), \
       CAST(COUNT(CASE WHEN parked_at IS NOT NULL THEN 1 END) AS SIGNED), \
       TIMESTAMPDIFF(MICROSECOND, \
           MIN(CASE WHEN published_at IS NULL AND parked_at IS NULL THEN created_at END), \
           UTC_TIMESTAMP(6)) / 1e6, \
       CAST(COUNT(CASE WHEN published_at >= UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE THEN 1 END) \
            AS SIGNED) \
FROM outbox_event \
WHERE published_at IS NULL OR published_at >= UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE \
GROUP BY topic ORDER BY topic";

/// The outbox per topic (every topic with unpublished or parked rows, or rows published in the
/// last minute), the dedup consumers' `processed_event` rows (counted), the relay instances
/// running on this database and the JetStream consumers' leases. The inbox's figures are empty:
/// inbox mode is not built for these databases yet.
pub async fn status(pool: &MySqlPool) -> Result<Status> {
    let mut status = outbox_status(pool).await?;
    status.processed_event_rows = sqlx::query_scalar("SELECT COUNT(*) FROM processed_event")
        .fetch_one(pool)
        .await?;
    status.consumer_leases = consumer_leases(pool).await?;
    Ok(status)
}

/// Each JetStream consumer group's lease on a topic, as on PostgreSQL.
async fn consumer_leases(pool: &MySqlPool) -> Result<Vec<ConsumerLease>> {
    sqlx::query(
        "SELECT CAST(group_id AS CHAR), CAST(topic AS CHAR), \
                CAST(holder IS NOT NULL AND expires_at > UTC_TIMESTAMP(6) AS SIGNED), \
                CASE WHEN holder IS NOT NULL \
                     THEN TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) / 1e6 END \
         FROM outbox_consumer_lease ORDER BY group_id, topic",
    )
    .fetch_all(pool)
    .await?
    .iter()
    .map(|r| {
        Ok(ConsumerLease {
            group: r.try_get(0)?,
            topic: r.try_get(1)?,
            owned: r.try_get::<i64, _>(2)? != 0,
            expires_in_secs: r.try_get(3)?,
        })
    })
    .collect()
}

/// [`status`] without counting `processed_event` (0 there): what a running relay reports every
/// few seconds, which must not scan a large table.
pub(crate) async fn outbox_status(pool: &MySqlPool) -> Result<Status> {
    let mut conn = pool.acquire().await?;
    let outbox = sqlx::query(OUTBOX_SQL)
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(|r| {
            Ok(TopicStatus {
                topic: r.try_get(0)?,
                unpublished: r.try_get(1)?,
                retrying: r.try_get(2)?,
                held: r.try_get(3)?,
                parked: r.try_get(4)?,
                oldest_unpublished_age_secs: r.try_get(5)?,
                published_last_minute: r.try_get(6)?,
            })
        })
        .collect::<Result<_>>()?;
    Ok(Status {
        outbox,
        inbox: Vec::new(),
        processed_event_rows: 0,
        relay_instances: members(&mut conn).await?,
        inbox_processors: 0,
        consumer_leases: Vec::new(),
    })
}

/// Live relay instances of this database: the member locks held.
pub(crate) async fn members(conn: &mut MySqlConnection) -> Result<i64> {
    Ok(sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM outbox_key_lock \
         WHERE bucket < {MEMBER_SLOTS} \
           AND IS_USED_LOCK(CONCAT({LOCK_PREFIX_SQL}, ':m:', bucket)) IS NOT NULL"
    ))
    .fetch_one(&mut *conn)
    .await?)
}
