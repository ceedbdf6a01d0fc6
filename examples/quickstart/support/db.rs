//! The two databases: created if they do not exist, migrated, with the services' tables; on
//! PostgreSQL, or on MariaDB/MySQL with `--database mariadb`.

use std::str::FromStr;

use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, MySqlPool, PgPool};
use uuid::Uuid;

use outbox_runtime::relay::Database;

use super::args;
use super::Result;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/outbox_quickstart";
const DEFAULT_MARIADB_URL: &str = "mysql://outbox:outbox@127.0.0.1:3306/outbox_quickstart";

/// The two services' databases, on one server.
pub enum Databases {
    Postgres {
        orders: PgPool,
        payments: PgPool,
    },
    MariaDb {
        orders: MySqlPool,
        payments: MySqlPool,
    },
}

/// The orders service's database, as its HTTP API and the demo use it.
#[derive(Clone)]
pub enum OrdersDb {
    Postgres(PgPool),
    MariaDb(MySqlPool),
}

impl Databases {
    /// The orders service's database (`DATABASE_URL`) and the payments service's (same name +
    /// `_payments`), created if need be, with the outbox migrations and their tables.
    pub async fn open(database: args::Database) -> Result<Databases> {
        let url = std::env::var("DATABASE_URL")
            .ok()
            .filter(|url| !url.is_empty());
        Ok(match database {
            args::Database::Postgres => {
                let url = url.unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned());
                let (orders, payments) = databases(&url).await?;
                Databases::Postgres { orders, payments }
            }
            args::Database::MariaDb => {
                let url = url.unwrap_or_else(|| DEFAULT_MARIADB_URL.to_owned());
                let (orders, payments) = mariadb_databases(&url).await?;
                Databases::MariaDb { orders, payments }
            }
        })
    }

    /// The two outboxes, as a relay takes them: the orders service's, the payments service's.
    pub fn outboxes(&self) -> (Database, Database) {
        match self {
            Databases::Postgres { orders, payments } => {
                (orders.clone().into(), payments.clone().into())
            }
            Databases::MariaDb { orders, payments } => {
                (orders.clone().into(), payments.clone().into())
            }
        }
    }

    /// The orders service's database.
    pub fn orders(&self) -> OrdersDb {
        match self {
            Databases::Postgres { orders, .. } => OrdersDb::Postgres(orders.clone()),
            Databases::MariaDb { orders, .. } => OrdersDb::MariaDb(orders.clone()),
        }
    }
}

impl OrdersDb {
    /// How many of the orders `ids` are paid.
    pub async fn paid(&self, ids: &[Uuid]) -> Result<i64> {
        Ok(match self {
            OrdersDb::Postgres(db) => {
                sqlx::query_scalar(
                    "SELECT count(*) FROM orders WHERE id = ANY($1) AND payment_status = 'paid'",
                )
                .bind(ids)
                .fetch_one(db)
                .await?
            }
            OrdersDb::MariaDb(db) => {
                // Literals, not placeholders: a statement takes at most 65,535 of those.
                let ids: Vec<String> = ids.iter().map(|id| format!("X'{}'", id.simple())).collect();
                let sql = format!(
                    "SELECT COUNT(*) FROM orders WHERE payment_status = 'paid' AND id IN ({})",
                    ids.join(", ")
                );
                sqlx::query_scalar(&sql).fetch_one(db).await?
            }
        })
    }
}

/// The PostgreSQL databases at `url`.
async fn databases(url: &str) -> Result<(PgPool, PgPool)> {
    let orders_options = PgConnectOptions::from_str(url)
        .map_err(|e| format!("DATABASE_URL `{url}` is not a PostgreSQL URL: {e}"))?
        .disable_statement_logging();
    let orders_name = orders_options
        .get_database()
        .ok_or("DATABASE_URL must name a database, as in postgres://host/outbox_quickstart")?
        .to_owned();
    let payments_options = orders_options
        .clone()
        .database(&format!("{orders_name}_payments"));
    let orders_db = connect_creating(&orders_options).await?;
    let payments_db = connect_creating(&payments_options).await?;
    outbox_runtime::migrate(&orders_db).await?;
    outbox_runtime::migrate(&payments_db).await?;
    create_tables(&orders_db, &orders_name, &payments_db).await?;
    Ok((orders_db, payments_db))
}

/// The orders service's `orders` table and the payments service's `payments` table.
async fn create_tables(orders_db: &PgPool, orders_name: &str, payments_db: &PgPool) -> Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (
            id uuid PRIMARY KEY,
            customer_id text NOT NULL,
            product_id text NOT NULL,
            amount bigint NOT NULL CHECK (amount > 0),
            payment_status text NOT NULL DEFAULT 'pending',
            created_at timestamptz NOT NULL DEFAULT now()
        )",
    )
    .execute(orders_db)
    .await?;
    // An `orders` table of another shape (an older quickstart's, say) would fail every insert.
    let columns: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.columns
         WHERE table_schema = current_schema() AND table_name = 'orders'
           AND (column_name, data_type) IN (('customer_id', 'text'), ('product_id', 'text'),
                                            ('amount', 'bigint'), ('payment_status', 'text'))",
    )
    .fetch_one(orders_db)
    .await?;
    if columns != 4 {
        let message = format!(
            "database {orders_name} already has an `orders` table of another shape (from an \
             older quickstart?): drop it, or set DATABASE_URL to another database"
        );
        return Err(message.into());
    }
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS payments (
            id uuid PRIMARY KEY,
            order_id uuid NOT NULL UNIQUE,
            amount bigint NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now()
        )",
    )
    .execute(payments_db)
    .await?;
    // Added after the first quickstart: the provider's charge and the attempt that made it.
    sqlx::query(
        "ALTER TABLE payments ADD COLUMN IF NOT EXISTS provider_charge text, \
             ADD COLUMN IF NOT EXISTS attempt integer",
    )
    .execute(payments_db)
    .await?;
    Ok(())
}

/// Connects to the database `options` names, creating it first if it does not exist.
async fn connect_creating(options: &PgConnectOptions) -> Result<PgPool> {
    let name = options.get_database().unwrap_or_default().to_owned();
    let server = format!("{}:{}", options.get_host(), options.get_port());
    let cannot_reach = |e: sqlx::Error| {
        format!("cannot reach PostgreSQL at {server}: {e} (start it, or set DATABASE_URL)")
    };
    // One connection first: it tells whether the database exists, and fails fast and clearly.
    match options.connect().await {
        Ok(_) => {}
        // 3D000: invalid_catalog_name, the database does not exist.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("3D000") => {
            if name.len() > 63 {
                let message =
                    format!("database name `{name}` is longer than PostgreSQL's 63 bytes");
                return Err(message.into());
            }
            let mut admin = options
                .clone()
                .database("postgres")
                .connect()
                .await
                .map_err(cannot_reach)?;
            let quoted = format!("\"{}\"", name.replace('"', "\"\""));
            match sqlx::query(&format!("CREATE DATABASE {quoted}"))
                .execute(&mut admin)
                .await
            {
                Ok(_) => println!("created database {name}"),
                // 42P04: duplicate_database, created meanwhile by someone else.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {}
                Err(e) => return Err(format!("cannot create database {name}: {e}").into()),
            }
        }
        Err(e) => return Err(cannot_reach(e).into()),
    }
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .connect_with(options.clone())
        .await
        .map_err(cannot_reach)?;
    Ok(pool)
}

/// The MariaDB/MySQL databases at `url` (`--database mariadb`), created if need be (the user
/// needs the privilege), with the outbox's MariaDB/MySQL migrations and the services' tables.
async fn mariadb_databases(url: &str) -> Result<(MySqlPool, MySqlPool)> {
    let options = MySqlConnectOptions::from_str(url)
        .map_err(|e| format!("DATABASE_URL `{url}` is not a MariaDB/MySQL URL: {e}"))?
        .disable_statement_logging();
    let orders_name = options
        .get_database()
        .ok_or("DATABASE_URL must name a database, as in mysql://host/outbox_quickstart")?
        .to_owned();
    let payments_name = format!("{orders_name}_payments");
    if payments_name.len() > 64 {
        return Err(format!("database name `{payments_name}` is longer than MariaDB's 64").into());
    }
    let server = format!("{}:{}", options.get_host(), options.get_port());
    let cannot_reach = |e: sqlx::Error| {
        format!(
            "cannot reach MariaDB at {server}: {e} (start it, or set DATABASE_URL; the default \
             user is created by root with: mariadb -e \"CREATE USER 'outbox'@'127.0.0.1' \
             IDENTIFIED BY 'outbox'; GRANT ALL ON *.* TO 'outbox'@'127.0.0.1'\")"
        )
    };
    // The server first, on a database of its own to exist (`information_schema`): it creates
    // the two databases if need be.
    let mut admin = options
        .clone()
        .database("information_schema")
        .connect()
        .await
        .map_err(cannot_reach)?;
    for name in [&orders_name, &payments_name] {
        let quoted = format!("`{}`", name.replace('`', "``"));
        sqlx::query(&format!("CREATE DATABASE IF NOT EXISTS {quoted}"))
            .execute(&mut admin)
            .await
            .map_err(|e| format!("cannot create database {name}: {e}"))?;
    }
    let pool = |name: &str| {
        MySqlPoolOptions::new()
            .max_connections(10)
            .connect_with(options.clone().database(name))
    };
    let orders_db = pool(&orders_name).await.map_err(cannot_reach)?;
    let payments_db = pool(&payments_name).await.map_err(cannot_reach)?;
    outbox_runtime::mysql::migrate(&orders_db).await?;
    outbox_runtime::mysql::migrate(&payments_db).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (
            id BINARY(16) PRIMARY KEY,
            customer_id VARCHAR(255) NOT NULL,
            product_id VARCHAR(255) NOT NULL,
            amount BIGINT NOT NULL CHECK (amount > 0),
            payment_status VARCHAR(16) NOT NULL DEFAULT 'pending',
            created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
        ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
    )
    .execute(&orders_db)
    .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS payments (
            id BINARY(16) PRIMARY KEY,
            order_id BINARY(16) NOT NULL UNIQUE,
            amount BIGINT NOT NULL,
            provider_charge VARCHAR(255),
            attempt INT,
            created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
        ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
    )
    .execute(&payments_db)
    .await?;
    Ok((orders_db, payments_db))
}
