//! Quickstart: commands that change the database and emit events atomically.
//!
//! ```sh
//! cargo run --example quickstart            # DATABASE_URL defaults to the local server
//! ```
//!
//! It creates its own database (`outbox_quickstart`) if missing, applies the migrations, places
//! a few orders (each an `orders` row and an `OrderCreated` outbox row in one transaction),
//! tries one invalid order to show that a failed command writes neither row, and prints the
//! outbox rows waiting for the relay.

use std::error::Error;
use std::str::FromStr;

use outbox_runtime::{OutboxEvent, Uow};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgPool};
use uuid::Uuid;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(
    topic = "order.events",
    aggregate_type = "Order",
    event_type = "OrderCreated"
)]
struct OrderCreated {
    #[outbox(aggregate_id)]
    order_id: Uuid,
    customer_id: Uuid,
    amount: i64,
}

/// The command handler: the domain row and its event commit together, or neither does.
async fn place_order(
    pool: &PgPool,
    customer_id: Uuid,
    amount: i64,
) -> outbox_runtime::Result<Uuid> {
    let order_id = Uuid::now_v7();
    let mut uow = Uow::begin(pool).await?;
    sqlx::query("INSERT INTO orders (id, customer_id, amount) VALUES ($1, $2, $3)")
        .bind(order_id)
        .bind(customer_id)
        .bind(amount)
        .execute(uow.tx())
        .await?;
    uow.emit(&OrderCreated {
        order_id,
        customer_id,
        amount,
    })
    .await?;
    uow.commit().await?;
    Ok(order_id)
}

/// Connects to `url`'s server and creates `database` there if it does not exist yet.
async fn connect_creating(url: &str, database: &str) -> Result<PgPool, Box<dyn Error>> {
    let server = PgConnectOptions::from_str(url)?;
    let mut admin = server.connect().await.map_err(|e| {
        format!("cannot reach PostgreSQL at {url}: {e} (set DATABASE_URL to a running server)")
    })?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(database)
            .fetch_one(&mut admin)
            .await?;
    if !exists {
        // `database` is a fixed identifier of this example, never user input.
        sqlx::query(&format!("CREATE DATABASE {database}"))
            .execute(&mut admin)
            .await?;
        println!("created database {database}");
    }
    Ok(PgPool::connect_with(server.database(database)).await?)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let pool = connect_creating(&url, "outbox_quickstart").await?;
    outbox_runtime::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (id uuid PRIMARY KEY, customer_id uuid NOT NULL, \
         amount bigint NOT NULL CHECK (amount > 0))",
    )
    .execute(&pool)
    .await?;

    let customer = Uuid::now_v7();
    for amount in [1_500, 2_750, 990] {
        let order_id = place_order(&pool, customer, amount).await?;
        println!("placed order {order_id} ({amount}): order row + OrderCreated event committed");
    }
    match place_order(&pool, customer, 0).await {
        Ok(id) => return Err(format!("order {id} with amount 0 should have been refused").into()),
        Err(e) => println!("refused an order of amount 0, nothing written: {e}"),
    }

    let (orders, unpublished): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM orders WHERE customer_id = $1), \
                (SELECT count(*) FROM outbox_event WHERE published_at IS NULL)",
    )
    .bind(customer)
    .fetch_one(&pool)
    .await?;
    println!("orders of this run: {orders}; outbox rows waiting for the relay: {unpublished}");
    let rows: Vec<(i64, String, String, serde_json::Value)> = sqlx::query_as(
        "SELECT id, topic, partition_key, payload FROM outbox_event ORDER BY id DESC LIMIT 3",
    )
    .fetch_all(&pool)
    .await?;
    for (id, topic, key, payload) in rows.into_iter().rev() {
        println!("  #{id} {topic} key={key} {payload}");
    }
    Ok(())
}
