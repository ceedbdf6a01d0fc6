//! The MariaDB and MySQL migrations (`migrations/mysql/`) and their runner.
//!
//! DDL commits on its own on these servers, so a migration cannot be all-or-nothing as on
//! PostgreSQL: each statement of one can run again after a run cut short (`IF NOT EXISTS`,
//! inserts that skip what is there), and the ledger records a migration after all of it ran.
//! `GET_LOCK` (named after the database) serializes runners that start at once.

use sqlx::{MySqlConnection, MySqlPool};

use crate::error::{Error, Result};
use crate::migrate::Migration;

/// Every MariaDB/MySQL migration, in the order they apply.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 20261207000001,
        description: "outbox_event",
        sql: include_str!("../../migrations/mysql/20261207000001_outbox_event.sql"),
    },
    Migration {
        version: 20261207000002,
        description: "relay",
        sql: include_str!("../../migrations/mysql/20261207000002_relay.sql"),
    },
    Migration {
        version: 20261207000003,
        description: "consumer",
        sql: include_str!("../../migrations/mysql/20261207000003_consumer.sql"),
    },
    Migration {
        version: 20261207000004,
        description: "operator_retries",
        sql: include_str!("../../migrations/mysql/20261207000004_operator_retries.sql"),
    },
    Migration {
        version: 20261207000005,
        description: "consumer_lease",
        sql: include_str!("../../migrations/mysql/20261207000005_consumer_lease.sql"),
    },
];

/// How long a runner waits for another to finish, in seconds.
const LOCK_WAIT_SECONDS: i64 = 300;

/// The oldest servers supported: MariaDB 10.6 (`SKIP LOCKED`) and MySQL 8.0.1.
const OLDEST_MARIADB: (u32, u32, u32) = (10, 6, 0);
const OLDEST_MYSQL: (u32, u32, u32) = (8, 0, 1);

const LEDGER_SQL: &str = "\
CREATE TABLE IF NOT EXISTS outbox_schema_migrations (
    version     BIGINT       NOT NULL,
    description VARCHAR(255) NOT NULL,
    checksum    BIGINT       NOT NULL,
    applied_at  DATETIME(6)  NOT NULL,
    PRIMARY KEY (version)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin";

/// Applies the pending migrations to the pool's database (idempotent).
///
/// Safe when several processes start at once (one applies, the others wait and then find
/// nothing to do). Fails, before changing anything, on a server older than MariaDB 10.6 or
/// MySQL 8.0.1, on a connection with no database, and if an applied migration was edited.
pub async fn migrate(pool: &MySqlPool) -> Result<()> {
    // Out of the pool: if this future is dropped half way, the connection closes, and its
    // GET_LOCK goes with it instead of staying held in the pool.
    let mut conn = pool.acquire().await?.detach();
    migrate_on(&mut conn).await
}

/// The migrations not applied to the pool's database yet (all of them on a fresh one). Fails
/// like [`migrate`] if an applied migration was edited.
pub async fn pending(pool: &MySqlPool) -> Result<Vec<Migration>> {
    let ledger: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.TABLES \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'outbox_schema_migrations'",
    )
    .fetch_one(pool)
    .await?;
    let applied: Vec<(i64, i64)> = if ledger > 0 {
        sqlx::query_as("SELECT version, checksum FROM outbox_schema_migrations")
            .fetch_all(pool)
            .await?
    } else {
        Vec::new()
    };
    crate::migrate::unapplied(MIGRATIONS, &applied)
}

/// [`migrate`] on a connection (not inside a transaction).
pub async fn migrate_on(conn: &mut MySqlConnection) -> Result<()> {
    let (version, database): (String, Option<String>) =
        sqlx::query_as("SELECT VERSION(), DATABASE()")
            .fetch_one(&mut *conn)
            .await?;
    check_version(&version)?;
    if database.is_none() {
        return Err(Error::Config(
            "the MySQL connection has no database: name one in the URL (mysql://host/database)"
                .into(),
        ));
    }
    let got: Option<i64> =
        sqlx::query_scalar("SELECT GET_LOCK(CONCAT('outbox:migrate:', MD5(DATABASE())), ?)")
            .bind(LOCK_WAIT_SECONDS)
            .fetch_one(&mut *conn)
            .await?;
    if got != Some(1) {
        return Err(Error::Config(format!(
            "another `migrate` of this database has held its lock for {LOCK_WAIT_SECONDS} s \
             (GET_LOCK('outbox:migrate:' || MD5(DATABASE()))): is one stuck?"
        )));
    }
    let result = apply(conn).await;
    let released = sqlx::query("DO RELEASE_LOCK(CONCAT('outbox:migrate:', MD5(DATABASE())))")
        .execute(&mut *conn)
        .await;
    result?;
    released?;
    Ok(())
}

async fn apply(conn: &mut MySqlConnection) -> Result<()> {
    sqlx::raw_sql(LEDGER_SQL).execute(&mut *conn).await?;
    let applied: Vec<(i64, i64)> =
        sqlx::query_as("SELECT version, checksum FROM outbox_schema_migrations")
            .fetch_all(&mut *conn)
            .await?;
    for m in crate::migrate::unapplied(MIGRATIONS, &applied)? {
        let checksum = m.checksum();
        let fail = |source| Error::Migration {
            version: m.version,
            description: m.description,
            source,
        };
        sqlx::raw_sql(m.sql)
            .execute(&mut *conn)
            .await
            .map_err(fail)?;
        sqlx::query(
            "INSERT INTO outbox_schema_migrations (version, description, checksum, applied_at) \
             VALUES (?, ?, ?, UTC_TIMESTAMP(6))",
        )
        .bind(m.version)
        .bind(m.description)
        .bind(checksum)
        .execute(&mut *conn)
        .await
        .map_err(fail)?;
        tracing::info!(
            version = m.version,
            description = m.description,
            "applied outbox migration (MySQL)"
        );
    }
    Ok(())
}

/// Refuses a server older than the oldest supported, from `VERSION()`: `10.11.6-MariaDB-...`
/// or `8.0.36`.
pub(super) fn check_version(version: &str) -> Result<()> {
    let mariadb = version.contains("MariaDB");
    let number: Vec<u32> = version
        .split(|c: char| !c.is_ascii_digit())
        .take(3)
        .map(|part| part.parse().unwrap_or(0))
        .collect();
    let found = (
        number.first().copied().unwrap_or(0),
        number.get(1).copied().unwrap_or(0),
        number.get(2).copied().unwrap_or(0),
    );
    let (oldest, name) = if mariadb {
        (OLDEST_MARIADB, "MariaDB")
    } else {
        (OLDEST_MYSQL, "MySQL")
    };
    if found < oldest {
        return Err(Error::Config(format!(
            "the server is {name} {version}; outbox needs {name} {}.{}.{} or later \
             (FOR UPDATE SKIP LOCKED)",
            oldest.0, oldest.1, oldest.2
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_version;

    #[test]
    fn old_servers_are_refused_with_the_version_needed() {
        assert!(check_version("10.11.19-MariaDB-0+deb12u1").is_ok());
        assert!(check_version("10.6.0-MariaDB").is_ok());
        assert!(check_version("11.4.2-MariaDB-log").is_ok());
        assert!(check_version("8.0.36").is_ok());
        assert!(check_version("8.4.0-commercial").is_ok());
        let old = check_version("10.5.23-MariaDB").unwrap_err().to_string();
        assert!(old.contains("MariaDB 10.6.0 or later"), "{old}");
        let old = check_version("5.7.44-log").unwrap_err().to_string();
        assert!(old.contains("MySQL 8.0.1 or later"), "{old}");
        assert!(check_version("8.0.0-dmr").is_err());
    }
}
