//! A fresh MariaDB (or MySQL) database per test, as `TestDb` is for PostgreSQL.
//!
//! The server is `MYSQL_URL` (default: the machine's MariaDB on 127.0.0.1:3306 as the user
//! `outbox`, password `outbox`). When that user cannot sign in, it is created through root's
//! local socket, as `.ci/run` does.

use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::mysql::MySqlPoolOptions;
use sqlx::{Connection, MySqlConnection, MySqlPool};

/// The server the MariaDB tests use.
pub fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://outbox:outbox@127.0.0.1:3306".to_owned())
}

/// The number `sql` selects, on a pool or a connection; panics naming the query if it fails.
pub async fn count<'e>(executor: impl sqlx::MySqlExecutor<'e>, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(executor)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// A database of its own for one test, dropped when the value drops, also on a panic.
#[derive(Debug)]
pub struct MySqlTestDb {
    pub pool: MySqlPool,
    pub name: String,
    /// URL of this database.
    pub url: String,
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

impl MySqlTestDb {
    /// A fresh database with the MySQL migrations applied.
    pub async fn new() -> Self {
        let db = Self::empty().await;
        outbox_runtime::mysql::migrate(&db.pool)
            .await
            .expect("migrations apply to a fresh database");
        db
    }

    /// A fresh database with nothing in it.
    pub async fn empty() -> Self {
        let name = format!(
            "outbox_test_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = admin_connection().await;
        sqlx::raw_sql(&format!(
            "DROP DATABASE IF EXISTS {name}; CREATE DATABASE {name}"
        ))
        .execute(&mut admin)
        .await
        .expect("create the test database");
        let url = crate::url_with_database(&mysql_url(), &name);
        let pool = MySqlPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .expect("connect to the test database");
        MySqlTestDb { pool, name, url }
    }

    /// A connection of its own to this database (outside the pool).
    pub async fn connection(&self) -> MySqlConnection {
        MySqlConnection::connect(&self.url)
            .await
            .expect("connect to the test database")
    }
}

/// A connection to the server as the tests' user, created through root's socket when missing.
async fn admin_connection() -> MySqlConnection {
    let url = mysql_url();
    if let Ok(conn) = MySqlConnection::connect(&url).await {
        return conn;
    }
    let created = std::process::Command::new("mariadb")
        .args([
            "-u",
            "root",
            "-e",
            "CREATE USER IF NOT EXISTS 'outbox'@'127.0.0.1' IDENTIFIED BY 'outbox'; \
             GRANT ALL PRIVILEGES ON *.* TO 'outbox'@'127.0.0.1'",
        ])
        .status();
    assert!(
        created.is_ok_and(|s| s.success()),
        "cannot create the tests' MariaDB user through root's socket (is MariaDB running?)"
    );
    MySqlConnection::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach MariaDB at {url}: {e} (is it running?)"))
}

impl Drop for MySqlTestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // As `TestDb`'s: a thread with its own runtime (the test's may be blocked here).
        let dropper = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let mut admin = admin_connection().await;
                // MySQL has no DROP DATABASE ... FORCE: end the database's sessions first (a
                // transaction left open by a panicking test holds locks DROP would wait for).
                let sessions: Vec<i64> = sqlx::query_scalar(
                    "SELECT CAST(ID AS SIGNED) FROM information_schema.PROCESSLIST WHERE DB = ?",
                )
                .bind(&name)
                .fetch_all(&mut admin)
                .await
                .unwrap_or_default();
                for id in sessions {
                    let _ = sqlx::query(&format!("KILL {id}")).execute(&mut admin).await;
                }
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
                    .execute(&mut admin)
                    .await;
            });
        });
        let _ = dropper.join();
    }
}
