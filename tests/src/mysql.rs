//! A fresh MariaDB (or MySQL) database per test, as `TestDb` is for PostgreSQL.
//!
//! The server is `MYSQL_URL` (default: the machine's MariaDB on 127.0.0.1:3306 as the user
//! `outbox`, password `outbox`). When that user cannot sign in, it is created through root's
//! local socket, as `.ci/run` does.

use std::collections::{HashMap, HashSet};
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

/// MariaDB with an `orders` table (`id`, `paid`, `refunded`), and the mock cluster with the
/// payments' topic, its retry topic and its dead-letter topic: what the MariaDB consumer tests
/// start from.
pub async fn payments_setup() -> (MySqlTestDb, crate::kafka::Kafka) {
    payments_setup_on(crate::kafka::Kafka::mock()).await
}

/// [`payments_setup`] on the given cluster.
pub async fn payments_setup_on(kafka: crate::kafka::Kafka) -> (MySqlTestDb, crate::kafka::Kafka) {
    use crate::fixtures::PAYMENTS;
    use crate::payments::PARTITIONS;

    let db = MySqlTestDb::new().await;
    create_orders(&db.pool).await;
    kafka.create_topic(PAYMENTS, PARTITIONS).await;
    kafka
        .create_topic(&format!("{PAYMENTS}.retry"), PARTITIONS)
        .await;
    kafka.create_topic(&format!("{PAYMENTS}.dlq"), 1).await;
    (db, kafka)
}

/// The `orders` table (`id`, `paid`, `refunded`).
pub async fn create_orders(pool: &MySqlPool) {
    sqlx::query(
        "CREATE TABLE orders (id BINARY(16) PRIMARY KEY, paid INT NOT NULL DEFAULT 0, \
         refunded INT NOT NULL DEFAULT 0)",
    )
    .execute(pool)
    .await
    .expect("create orders");
}

/// `sql`'s count, asked again while the server does not answer (within 60 s): for a test that
/// kills its server.
pub async fn count_when_up(pool: &MySqlPool, sql: &str) -> i64 {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match sqlx::query_scalar(sql).fetch_one(pool).await {
            Ok(n) => return n,
            Err(e) => {
                assert!(tokio::time::Instant::now() < deadline, "{sql}: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

/// Marks the order paid (`orders.paid` + 1; see [`create_orders`]): `fixtures::mark_order_paid`
/// on MariaDB/MySQL.
#[outbox_runtime::inbox_handler]
pub async fn mark_order_paid(
    event: crate::fixtures::PaymentSucceeded,
    tx: &mut MySqlConnection,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = ?")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    Ok(())
}

/// Records the step of a deposit in `steps` (`n` AUTO_INCREMENT, `account`, `seq`: see
/// [`create_steps`]), in the consumer's transaction.
#[outbox_runtime::inbox_handler]
pub async fn record_step(
    event: crate::deposits::Deposited,
    tx: &mut MySqlConnection,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    insert_step(tx, &event).await
}

/// Records the step of `event` in `steps`, in the handler's transaction.
pub async fn insert_step(
    tx: &mut MySqlConnection,
    event: &crate::deposits::Deposited,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    sqlx::query("INSERT INTO steps (account, seq) VALUES (?, ?)")
        .bind(&event.account)
        .bind(event.seq as i64)
        .execute(tx)
        .await?;
    Ok(())
}

/// [`record_step`], noting the attempt in [`ATTEMPTS`](crate::deposits::ATTEMPTS).
#[outbox_runtime::inbox_handler]
pub async fn record_step_and_attempt(
    event: crate::deposits::Deposited,
    tx: &mut MySqlConnection,
    meta: &outbox_runtime::inbox::MessageMeta<'_>,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    insert_step(tx, &event).await?;
    crate::deposits::ATTEMPTS
        .lock()
        .unwrap()
        .insert(meta.event_id(), meta.attempt());
    Ok(())
}

/// The `steps` table [`record_step`] writes.
pub async fn create_steps(pool: &MySqlPool) {
    sqlx::query(
        "CREATE TABLE steps (n BIGINT AUTO_INCREMENT PRIMARY KEY, account VARCHAR(64) NOT NULL, \
         seq BIGINT NOT NULL)",
    )
    .execute(pool)
    .await
    .expect("create steps");
}

/// Each account's steps, in the order they were handled.
pub async fn steps(pool: &MySqlPool) -> std::collections::BTreeMap<String, Vec<i64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT account, seq FROM steps ORDER BY n")
        .fetch_all(pool)
        .await
        .expect("read steps");
    let mut by_account = std::collections::BTreeMap::<String, Vec<i64>>::new();
    for (account, seq) in rows {
        by_account.entry(account).or_default().push(seq);
    }
    by_account
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

/// A MariaDB server of a test's own (`mariadbd` from Debian's package, its own data directory
/// and port), to kill and start again; root signs in without a password from 127.0.0.1, and the
/// tests' user `outbox` exists. Killed, and its directory removed, when dropped.
#[derive(Debug)]
pub struct MariaDbServer {
    port: u16,
    dir: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl MariaDbServer {
    pub async fn start() -> MariaDbServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let dir = std::env::temp_dir().join(format!("outbox-mariadb-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("data directory");
        // One at a time in a test binary: two installs at once failed once here.
        static INSTALLING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let run = |program: &str, args: &[&str]| {
            let _one = INSTALLING.lock().unwrap_or_else(|e| e.into_inner());
            let output = std::process::Command::new(program).args(args).output();
            match output {
                Ok(o) if o.status.success() => {}
                Ok(o) => panic!(
                    "{program} {args:?} failed ({}): {}{}",
                    o.status,
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ),
                Err(e) => panic!("{program} {args:?} did not run: {e}"),
            }
        };
        let d = dir
            .to_str()
            .expect("a UTF-8 temporary directory")
            .to_owned();
        run("chown", &["mysql:mysql", &d]);
        run(
            "mariadb-install-db",
            &[
                "--no-defaults",
                &format!("--datadir={d}/data"),
                "--user=mysql",
                "--auth-root-authentication-method=normal",
            ],
        );
        let mut server = MariaDbServer {
            port,
            dir,
            child: None,
        };
        server.spawn().await;
        let mut root = server.root().await;
        sqlx::raw_sql(
            "CREATE USER 'outbox'@'127.0.0.1' IDENTIFIED BY 'outbox'; \
             GRANT ALL PRIVILEGES ON *.* TO 'outbox'@'127.0.0.1'",
        )
        .execute(&mut root)
        .await
        .expect("create the tests' user");
        server
    }

    /// Starts `mariadbd` and waits until root can sign in (crash recovery included).
    async fn spawn(&mut self) {
        let d = self.dir.to_str().expect("UTF-8").to_owned();
        let child = std::process::Command::new("mariadbd")
            .args([
                "--no-defaults",
                &format!("--datadir={d}/data"),
                &format!("--port={}", self.port),
                "--bind-address=127.0.0.1",
                &format!("--socket={d}/sock"),
                &format!("--pid-file={d}/pid"),
                "--user=mysql",
                &format!("--log-error={d}/err.log"),
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start mariadbd");
        self.child = Some(child);
        let _ = self.root().await;
    }

    /// A connection as root, once the server answers (within 60 s).
    pub async fn root(&self) -> MySqlConnection {
        let url = format!("mysql://root@127.0.0.1:{}/", self.port);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            match MySqlConnection::connect(&url).await {
                Ok(conn) => return conn,
                Err(e) => {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "mariadbd on port {} does not answer: {e}",
                        self.port
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            }
        }
    }

    /// The URL of `database` on this server, as the tests' user.
    pub fn url(&self, database: &str) -> String {
        format!("mysql://outbox:outbox@127.0.0.1:{}/{database}", self.port)
    }

    /// A fresh database on this server, migrated, and a pool of `connections` to it.
    pub async fn database(&self, name: &str, connections: u32) -> MySqlPool {
        let mut root = self.root().await;
        sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
            .execute(&mut root)
            .await
            .expect("create the database");
        let pool = MySqlPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(std::time::Duration::from_secs(5))
            .connect(&self.url(name))
            .await
            .expect("connect to the test server");
        outbox_runtime::mysql::migrate(&pool)
            .await
            .expect("migrate the test server's database");
        pool
    }

    /// SIGKILL: no shutdown, InnoDB recovers at the next start.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again (after [`kill`](Self::kill)) on the same data and port.
    pub async fn restart(&mut self) {
        self.spawn().await;
    }
}

impl Drop for MariaDbServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Checks what Kafka received against the outbox: every row arrived, each as written, and the
/// first copy of each key's events came in `id` order. Returns the duplicates.
pub async fn check_delivery(
    pool: &MySqlPool,
    received: &[crate::kafka::Received],
    expected: usize,
) -> usize {
    let rows: Vec<(i64, String, String, String)> = sqlx::query_as(
        "SELECT id, LOWER(HEX(event_id)), CAST(partition_key AS CHAR), CAST(payload AS CHAR) \
         FROM outbox_event",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), expected);
    let by_id: HashMap<i64, _> = rows.iter().map(|r| (r.0, r)).collect();
    let mut seen = HashSet::new();
    let mut last_of_key: HashMap<&str, i64> = HashMap::new();
    let mut duplicates = 0;
    for r in received {
        let id = r.outbox_id();
        let row = by_id
            .get(&id)
            .unwrap_or_else(|| panic!("record of unknown outbox id {id}"));
        assert_eq!(r.header("event_id").replace('-', ""), row.1);
        assert_eq!(r.key, row.2);
        assert_eq!(r.header("aggregate_type"), "Account");
        assert_eq!(r.header("event_type"), "Deposited");
        let stored: serde_json::Value = serde_json::from_str(&row.3).unwrap();
        assert_eq!(r.payload, stored);
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        let last = last_of_key.entry(row.2.as_str()).or_insert(0);
        assert!(
            id > *last,
            "key {} went out of order: outbox id {id} after {}",
            row.2,
            *last
        );
        *last = id;
    }
    assert_eq!(seen.len(), expected, "every event arrived");
    duplicates
}
