//! [`health`] on MariaDB/MySQL: the backlog's warnings, as on PostgreSQL (old unpublished rows,
//! held keys, parked rows), the transactions that hold InnoDB's purge back, with the history
//! list length, and those waiting long for a lock, with the connection that holds it; and the retry and dead-letter topics consumers found missing. Needs the `PROCESS` privilege (to see other connections'
//! transactions); without it, it says so.

use std::collections::HashMap;

use sqlx::{MySqlConnection, MySqlPool, Row};

use super::assess;
use super::probes::{Held, MissingTopic};
use super::{Health, HealthThresholds, Warning};
use crate::error::{Error, Result};

/// The health of the outbox on a MariaDB/MySQL database: its figures ([`status`]) and the
/// warnings that apply there (`outbox status --check` with a `mysql://` URL).
///
/// [`status`]: crate::mysql::status
pub async fn health(pool: &MySqlPool, thresholds: &HealthThresholds) -> Result<Health> {
    let status = crate::admin::mysql::status(pool).await?;
    assess_on(pool, thresholds, status, false).await
}

/// [`health`] without counting `processed_event` (its figure 0): what a running relay checks on
/// its schedule, which must not scan a large table. Without the `PROCESS` privilege it leaves
/// out the checks of InnoDB's transactions (saying so once per process) and makes the rest.
pub(crate) async fn health_uncounted(
    pool: &MySqlPool,
    thresholds: &HealthThresholds,
) -> Result<Health> {
    let status = crate::admin::mysql::outbox_status(pool).await?;
    assess_on(pool, thresholds, status, true).await
}

/// The warnings, given the figures. `partial`: without `PROCESS`, no transaction checks
/// rather than an error.
async fn assess_on(
    pool: &MySqlPool,
    thresholds: &HealthThresholds,
    status: crate::admin::Status,
    partial: bool,
) -> Result<Health> {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let mut conn = pool.acquire().await?;
    let transactions = match transactions(&mut conn).await {
        Err(Error::Config(e)) if partial => {
            if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(error = %e, "outbox health: transactions holding InnoDB's purge back and lock waits are not checked without the PROCESS privilege; the backlog's checks go on");
            }
            Vec::new()
        }
        found => found?,
    };
    let oldest_transaction_age_secs = transactions.first().map(|t| t.age_secs);
    let history_list_length = history_list_length(&mut conn).await;
    let mut warnings = Vec::new();
    let waits_long = |t: &Transaction| {
        t.waiting_secs
            .is_some_and(|w| w >= thresholds.lock_wait.as_secs_f64())
    };
    let blockers = if transactions.iter().any(waits_long) {
        blockers(&mut conn).await
    } else {
        HashMap::new()
    };
    for t in &transactions {
        if let (true, Some(waited_secs)) = (waits_long(t), t.waiting_secs) {
            warnings.push(Warning::LockWait {
                thread_id: t.thread_id,
                host: t.host.clone(),
                user: t.user.clone(),
                waited_secs,
                blocking_thread_id: blockers.get(&t.thread_id).copied(),
            });
        }
    }
    for t in transactions {
        let idle = Some(t.idle_secs).filter(|_| t.command == "Sleep");
        if assess::held_too_long(t.age_secs, idle, thresholds) {
            warnings.push(Warning::InnodbTransaction {
                thread_id: t.thread_id,
                host: t.host,
                user: t.user,
                command: t.command,
                age_secs: t.age_secs,
                history_list_length,
            });
        }
    }
    let held = if status.outbox.iter().any(|t| t.held > 0) {
        held_keys(&mut conn).await?
    } else {
        Vec::new()
    };
    warnings.extend(assess::backlog(&status, held, thresholds));
    warnings.extend(assess::missing_topics(missing_topics(&mut conn).await?));
    warnings.retain(|w| !thresholds.ignores(w.kind()));
    Ok(Health {
        status,
        // Not PostgreSQL's: InnoDB purges on its own.
        autovacuum: true,
        tables: Vec::new(),
        oldest_transaction_age_secs,
        warnings,
    })
}

/// A running InnoDB transaction of another connection.
struct Transaction {
    thread_id: i64,
    host: String,
    user: String,
    command: String,
    age_secs: f64,
    /// Seconds in its current command (`Sleep`: idle).
    idle_secs: f64,
    /// Seconds it has waited for a lock, if it waits for one.
    waiting_secs: Option<f64>,
}

/// Every other connection's open transaction, the oldest first. InnoDB's times are in the
/// server's system time zone, `NOW()` in the session's (UTC for sqlx's, any for an
/// application's): the ages compare them in the first. The seconds are made doubles by `* 1e0`
/// and `/ 1e6` (a double literal), not `CAST(... AS DOUBLE)`, which MySQL takes only from
/// 8.0.17.
async fn transactions(conn: &mut MySqlConnection) -> Result<Vec<Transaction>> {
    let rows = sqlx::query(
        "SELECT CAST(t.trx_mysql_thread_id AS SIGNED), CAST(COALESCE(p.HOST, '') AS CHAR), \
                CAST(COALESCE(p.USER, '') AS CHAR), CAST(COALESCE(p.COMMAND, '') AS CHAR), \
                TIMESTAMPDIFF(SECOND, t.trx_started, \
                    CONVERT_TZ(NOW(), @@session.time_zone, 'SYSTEM')) * 1e0, \
                COALESCE(p.TIME, 0) * 1e0, \
                CASE WHEN t.trx_state = 'LOCK WAIT' THEN TIMESTAMPDIFF(MICROSECOND, \
                    t.trx_wait_started, CONVERT_TZ(NOW(), @@session.time_zone, 'SYSTEM')) \
                    / 1e6 END \
         FROM information_schema.INNODB_TRX t \
         LEFT JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id \
         WHERE t.trx_mysql_thread_id <> CONNECTION_ID() \
         ORDER BY t.trx_started",
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| {
        if crate::sqlstate::DbError::is_access_denied(&e) {
            Error::Config(format!(
                "the health checks read information_schema.INNODB_TRX, which needs the PROCESS \
                 privilege (GRANT PROCESS ON *.* TO ...): {e}"
            ))
        } else {
            Error::Database(e)
        }
    })?;
    rows.iter()
        .map(|r| {
            Ok(Transaction {
                thread_id: r.try_get(0)?,
                host: r.try_get(1)?,
                user: r.try_get(2)?,
                command: r.try_get(3)?,
                age_secs: r.try_get(4)?,
                idle_secs: r.try_get(5)?,
                waiting_secs: r.try_get(6)?,
            })
        })
        .collect()
}

/// Which connection's transaction each waiting connection waits for: MariaDB's
/// `information_schema.INNODB_LOCK_WAITS`, or MySQL 8's `performance_schema.data_lock_waits`
/// (MariaDB has no such table, MySQL 8 no longer the first); empty when neither can be read.
async fn blockers(conn: &mut MySqlConnection) -> HashMap<i64, i64> {
    for (waits, requesting, blocking) in [
        (
            "information_schema.INNODB_LOCK_WAITS",
            "requesting_trx_id",
            "blocking_trx_id",
        ),
        (
            "performance_schema.data_lock_waits",
            "REQUESTING_ENGINE_TRANSACTION_ID",
            "BLOCKING_ENGINE_TRANSACTION_ID",
        ),
    ] {
        let pairs: sqlx::Result<Vec<(i64, i64)>> = sqlx::query_as(&format!(
            "SELECT CAST(r.trx_mysql_thread_id AS SIGNED), CAST(b.trx_mysql_thread_id AS SIGNED) \
             FROM {waits} w \
             JOIN information_schema.INNODB_TRX r ON r.trx_id = w.{requesting} \
             JOIN information_schema.INNODB_TRX b ON b.trx_id = w.{blocking}"
        ))
        .fetch_all(&mut *conn)
        .await;
        if let Ok(pairs) = pairs {
            return pairs.into_iter().collect();
        }
    }
    HashMap::new()
}

/// InnoDB's history list length (MariaDB's status variable; MySQL has it only in
/// `INNODB_METRICS`), `None` where it cannot be read.
async fn history_list_length(conn: &mut MySqlConnection) -> Option<i64> {
    let mariadb: Option<(String, String)> =
        sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_history_list_length'")
            .fetch_optional(&mut *conn)
            .await
            .ok()
            .flatten();
    if let Some((_, value)) = mariadb {
        return value.parse().ok();
    }
    sqlx::query_scalar(
        "SELECT CAST(COUNT AS SIGNED) FROM information_schema.INNODB_METRICS \
         WHERE NAME = 'trx_rseg_history_len'",
    )
    .fetch_optional(&mut *conn)
    .await
    .ok()
    .flatten()
}

/// The held keys, by topic.
async fn held_keys(conn: &mut MySqlConnection) -> Result<Vec<Held>> {
    let rows = sqlx::query(
        "SELECT CAST(topic AS CHAR), COUNT(*), COUNT(DISTINCT partition_key), \
                CAST(MAX(last_error) AS CHAR) \
         FROM outbox_event \
         WHERE published_at IS NULL AND parked_at IS NULL AND held_at IS NOT NULL \
         GROUP BY topic ORDER BY topic",
    )
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Held {
                topic: r.try_get(0)?,
                rows: r.try_get(1)?,
                keys: r.try_get(2)?,
                error: r.try_get(3)?,
            })
        })
        .collect()
}

/// The retry and dead-letter topics consumers recorded missing (none before migration 3, which
/// made their table).
async fn missing_topics(conn: &mut MySqlConnection) -> Result<Vec<MissingTopic>> {
    let rows = sqlx::query(
        "SELECT CAST(group_id AS CHAR), CAST(topic AS CHAR), CAST(source_topic AS CHAR), \
                CAST(role AS CHAR), TIMESTAMPDIFF(MICROSECOND, seen_at, UTC_TIMESTAMP(6)) \
         FROM outbox_consumer_missing_topic ORDER BY group_id, topic",
    )
    .fetch_all(conn)
    .await;
    let rows = match rows {
        Ok(rows) => rows,
        Err(e) if crate::sqlstate::DbError::is_undefined_table(&e) => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    rows.into_iter()
        .map(|row| {
            Ok(MissingTopic {
                group: row.try_get(0)?,
                topic: row.try_get(1)?,
                source: row.try_get(2)?,
                role: row.try_get(3)?,
                age_secs: row.try_get::<i64, _>(4)? as f64 / 1e6,
            })
        })
        .collect()
}
