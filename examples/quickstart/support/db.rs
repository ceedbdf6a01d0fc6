//! The two databases: created if they do not exist, migrated, with the services' tables.

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

use super::Result;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/outbox_quickstart";

/// The orders service's database (`DATABASE_URL`) and the payments service's (same name +
/// `_payments`), created if need be, with the outbox migrations and their tables.
pub async fn databases() -> Result<(PgPool, PgPool)> {
    let url = std::env::var("DATABASE_URL")
        .ok()
        .filter(|url| !url.is_empty())
        .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned());
    let orders_options = PgConnectOptions::from_str(&url)
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
