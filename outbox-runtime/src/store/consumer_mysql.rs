//! The consumers' SQL on MariaDB/MySQL outside a batch's transactions (which are
//! `inbox/batch_mysql.rs`'s): whether an event's effect is recorded, and the missing retry and
//! dead-letter topics a group records.

#[cfg(feature = "kafka")]
use sqlx::Executor;
use sqlx::MySqlPool;
#[cfg(feature = "rabbitmq")]
use uuid::Uuid;

#[cfg(feature = "kafka")]
use super::literal_mysql::push_text;
use crate::error::Result;

/// Whether `processed_event` holds event `event_id`, for any handler: RabbitMQ's consumer asks
/// it of a redelivered message's predecessor.
#[cfg(feature = "rabbitmq")]
pub(crate) async fn holds(pool: &MySqlPool, event_id: Uuid) -> Result<bool> {
    let held: i64 =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM processed_event WHERE event_id = ?)")
            .bind(event_id)
            .fetch_one(pool)
            .await?;
    Ok(held != 0)
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
