//! Test support: a fresh PostgreSQL database per test, and a proxy that counts round trips.

/// The README's Rust code blocks, compiled as doc-tests (`cargo test --doc -p outbox-tests`).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

/// The runtime crate's README (crates.io's page), compiled the same way.
#[cfg(doctest)]
#[doc = include_str!("../../outbox-runtime/README.md")]
pub struct RuntimeReadmeDoctests;

pub mod bench;
pub mod browser;
pub mod contract;
pub mod deposits;
pub mod fixtures;
pub mod kafka;
pub mod log;
pub mod metrics;
pub mod mysql;
pub mod nats;
pub mod payments;
pub mod proxy;
pub mod rabbitmq;
pub mod running;
pub mod stopping;

pub use running::Running;

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

/// The server tests use: `DATABASE_URL`, or the local default.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// `url` with its database replaced by `database`.
pub fn url_with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_end = base.find("://").map_or(0, |i| i + 3);
    let base = match base[authority_end..].find('/') {
        Some(slash) => &base[..authority_end + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{base}/{database}?{query}"),
        None => format!("{base}/{database}"),
    }
}

/// The number `sql` selects (a `count(*)`), on a pool or inside a transaction; panics naming the
/// query if it fails.
pub async fn count<'e>(executor: impl sqlx::PgExecutor<'e>, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(executor)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// A database of its own for one test, dropped (with its connections) when the value drops,
/// also when the test panics.
#[derive(Debug)]
pub struct TestDb {
    pub pool: PgPool,
    pub name: String,
    /// URL of this database.
    pub url: String,
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

impl TestDb {
    /// A fresh database with the outbox migrations applied.
    pub async fn new() -> Self {
        let db = Self::empty().await;
        outbox_runtime::migrate(&db.pool)
            .await
            .expect("migrations apply to a fresh database");
        db
    }

    /// A fresh database migrated as an installation from before partitioned storage is:
    /// the migrations up to it applied, then a dedup record written (as consumers had), then
    /// the rest, which keep an installation with rows as it is: `processed_event`,
    /// `inbox_event` and `outbox_event` stay plain tables. The record is deleted again.
    pub async fn before_partitions() -> Self {
        let db = Self::migrated_until("processed_event_partitions").await;
        let mut conn = db.pool.acquire().await.unwrap();
        let record = uuid::Uuid::new_v4();
        sqlx::query("INSERT INTO processed_event (event_id, handler) VALUES ($1, 'before')")
            .bind(record)
            .execute(&mut *conn)
            .await
            .unwrap();
        outbox_runtime::migrate(&db.pool)
            .await
            .expect("the later migrations apply to an existing installation");
        sqlx::query("DELETE FROM processed_event WHERE event_id = $1")
            .bind(record)
            .execute(&mut *conn)
            .await
            .unwrap();
        drop(conn);
        db
    }

    /// A fresh database with the migrations before the one named `description` applied (and
    /// recorded, as `outbox_runtime::migrate` records them): an installation of an earlier
    /// version, which `outbox_runtime::migrate` then upgrades.
    pub async fn migrated_until(description: &str) -> Self {
        let db = Self::empty().await;
        let until = outbox_runtime::migrate::MIGRATIONS
            .iter()
            .position(|m| m.description == description)
            .unwrap_or_else(|| panic!("no migration {description}"));
        let mut conn = db.pool.acquire().await.unwrap();
        sqlx::raw_sql(
            "CREATE TABLE outbox_schema_migrations (version bigint PRIMARY KEY, \
             description text NOT NULL, checksum bigint NOT NULL, \
             applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .execute(&mut *conn)
        .await
        .unwrap();
        for m in &outbox_runtime::migrate::MIGRATIONS[..until] {
            sqlx::raw_sql(m.sql).execute(&mut *conn).await.unwrap();
            sqlx::query(
                "INSERT INTO outbox_schema_migrations (version, description, checksum) \
                 VALUES ($1, $2, $3)",
            )
            .bind(m.version)
            .bind(m.description)
            .bind(m.checksum())
            .execute(&mut *conn)
            .await
            .unwrap();
        }
        drop(conn);
        db
    }

    /// A fresh database without migrations.
    pub async fn empty() -> Self {
        let name = format!(
            "outbox_test_{}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            uuid::Uuid::new_v4().simple()
        );
        let mut admin = admin_connection().await;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .expect("create test database");
        let url = url_with_database(&database_url(), &name);
        let pool = Self::pool_for(&url, 20).await;
        TestDb { pool, name, url }
    }

    /// Another pool on this database.
    pub async fn pool(&self, max_connections: u32) -> PgPool {
        Self::pool_for(&self.url, max_connections).await
    }

    /// A pool whose connections work in `schema` (created if missing; its `search_path`), with
    /// the outbox migrations applied there: a second installation in the same database.
    pub async fn pool_in_schema(&self, schema: &str, max_connections: u32) -> PgPool {
        sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
            .execute(&self.pool)
            .await
            .expect("create schema");
        let options = PgConnectOptions::from_str(&self.url)
            .expect("valid DATABASE_URL")
            .options([("search_path", schema)])
            .disable_statement_logging();
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(options)
            .await
            .expect("connect to the test database");
        outbox_runtime::migrate(&pool)
            .await
            .expect("migrations apply to a fresh schema");
        pool
    }

    async fn pool_for(url: &str, max_connections: u32) -> PgPool {
        let options = PgConnectOptions::from_str(url)
            .expect("valid DATABASE_URL")
            .disable_statement_logging();
        PgPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(options)
            .await
            .expect("connect to the test database")
    }
}

async fn admin_connection() -> PgConnection {
    let url = database_url();
    if let Ok(conn) = PgConnection::connect(&url).await {
        return conn;
    }
    start_local_postgres().await;
    PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {url}: {e} (is it running?)"))
}

/// A session of its own, idle in a transaction that holds an id: what holds back PostgreSQL's
/// cleanup horizon (a forgotten `BEGIN` in psql, a stuck migration). It ends with
/// [`commit`](Self::commit), or when dropped (its connection closes).
pub struct HeldTransaction {
    conn: PgConnection,
    /// The session's backend pid, as `pg_stat_activity` shows it.
    pub pid: i32,
}

impl HeldTransaction {
    /// Connects to `url` as `application_name`, begins, and takes a transaction id.
    pub async fn open(url: &str, application_name: &str) -> HeldTransaction {
        let options = PgConnectOptions::from_str(url)
            .expect("a database URL")
            .application_name(application_name);
        let mut conn = options.connect().await.expect("connect");
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
        sqlx::query("SELECT txid_current()")
            .execute(&mut conn)
            .await
            .unwrap();
        HeldTransaction { conn, pid }
    }

    /// Ends the transaction.
    pub async fn commit(mut self) {
        sqlx::query("COMMIT").execute(&mut self.conn).await.unwrap();
    }
}

/// Restarts the machine's PostgreSQL cluster (`pg_ctlcluster ... restart`) and waits until it
/// accepts connections again. Every connection to it breaks. Only for tests that run alone (a
/// step of their own in `.ci/run`).
pub async fn restart_postgres() {
    let url = database_url();
    let started = |url: String| async move {
        let mut conn = PgConnection::connect(&url).await.ok()?;
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>("SELECT pg_postmaster_start_time()")
            .fetch_one(&mut conn)
            .await
            .ok()
    };
    let before = started(url.clone())
        .await
        .expect("PostgreSQL is up before its restart");
    let version = std::fs::read_dir("/etc/postgresql")
        .ok()
        .and_then(|mut dir| dir.next())
        .and_then(|entry| entry.ok())
        .map(|entry| entry.file_name())
        .expect("a local PostgreSQL cluster under /etc/postgresql");
    let status = tokio::process::Command::new("pg_ctlcluster")
        .arg("--skip-systemctl-redirect")
        .arg(&version)
        .args(["main", "restart"])
        .status()
        .await
        .expect("run pg_ctlcluster");
    assert!(status.success(), "pg_ctlcluster restart failed: {status}");
    for _ in 0..600 {
        if let Some(after) = started(url.clone()).await {
            assert!(after > before, "PostgreSQL was not restarted");
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("PostgreSQL did not come back within 30 s");
}

/// Starts the machine's PostgreSQL cluster if it is down (once per test process), and waits
/// until it accepts connections. Does nothing useful for a remote `DATABASE_URL`.
async fn start_local_postgres() {
    static STARTED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    STARTED
        .get_or_init(|| async {
            let Some(version) = std::fs::read_dir("/etc/postgresql")
                .ok()
                .and_then(|mut dir| dir.next())
                .and_then(|entry| entry.ok())
                .map(|entry| entry.file_name())
            else {
                return;
            };
            let _ = tokio::process::Command::new("pg_ctlcluster")
                .arg("--skip-systemctl-redirect")
                .arg(&version)
                .args(["main", "start"])
                .status()
                .await;
            let url = database_url();
            for _ in 0..300 {
                if PgConnection::connect(&url).await.is_ok() {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        })
        .await;
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // The test's runtime may be single-threaded and blocked here: use a thread with its own
        // runtime, and leave the pool alone (FORCE ends its connections).
        let dropper = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let mut admin = admin_connection().await;
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&mut admin)
                    .await;
            });
        });
        let _ = dropper.join();
    }
}

/// A child process that is killed (SIGKILL) when dropped, also when a test panics.
#[derive(Debug)]
pub struct ChildGuard(pub std::process::Child);

impl ChildGuard {
    /// Kills the process now and reaps it.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}
