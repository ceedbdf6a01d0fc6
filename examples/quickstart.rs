//! Quickstart: commands that change the database and emit events atomically, and the relay
//! that publishes them to Kafka.
//!
//! ```sh
//! cargo run --example quickstart
//! ```
//!
//! Without configuration it uses the local PostgreSQL (`DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/postgres`; it creates its own database
//! `outbox_quickstart`) and an embedded Kafka (librdkafka's mock cluster); set `KAFKA_BROKERS`
//! to use a real broker. It places a few orders (each an `orders` row and an `OrderCreated`
//! outbox row in one transaction), tries an invalid one (nothing is written), runs the relay
//! as a background task, reads the events back from Kafka, and shuts the relay down gracefully.

use std::error::Error;
use std::str::FromStr;
use std::time::Duration;

use outbox_runtime::relay::Relay;
use outbox_runtime::{OutboxEvent, Uow};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::mocking::MockCluster;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgPool};
use tokio_util::sync::CancellationToken;
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

    // Kafka: KAFKA_BROKERS, or an embedded mock cluster that lives as long as this program.
    let mock;
    let brokers = match std::env::var("KAFKA_BROKERS") {
        Ok(brokers) => brokers,
        Err(_) => {
            mock = MockCluster::new(1)?;
            mock.create_topic("order.events", 3, 1)?;
            println!(
                "embedded Kafka (mock cluster) at {}",
                mock.bootstrap_servers()
            );
            mock.bootstrap_servers()
        }
    };

    // The relay runs beside the application and stops with it.
    let relay = Relay::builder(pool.clone()).brokers(&brokers).build()?;
    let cancel = CancellationToken::new();
    let relay_task = relay.spawn(cancel.clone());

    // A reader of the topic from its beginning, standing in for another service.
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", "outbox-quickstart")
        .set("enable.auto.commit", "false")
        .create()?;
    let partitions = consumer
        .fetch_metadata(Some("order.events"), Duration::from_secs(10))?
        .topics()
        .first()
        .map_or(1, |t| t.partitions().len() as i32);
    let mut assignment = TopicPartitionList::new();
    for partition in 0..partitions {
        assignment.add_partition_offset("order.events", partition, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;

    let customer = Uuid::now_v7();
    let mut placed = Vec::new();
    for amount in [1_500, 2_750, 990] {
        let order_id = place_order(&pool, customer, amount).await?;
        println!("placed order {order_id} ({amount}): order row + OrderCreated event committed");
        placed.push(order_id);
    }
    match place_order(&pool, customer, 0).await {
        Ok(id) => return Err(format!("order {id} with amount 0 should have been refused").into()),
        Err(e) => println!("refused an order of amount 0, nothing written: {e}"),
    }

    // Read the events back: the relay publishes them within milliseconds of the commit.
    let mut seen = 0;
    while seen < placed.len() {
        let message = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
            .await
            .map_err(|_| "no event arrived from Kafka within 30 s")??;
        let event_id = message
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "event_id"))
            .and_then(|h| h.value)
            .map(String::from_utf8_lossy)
            .unwrap_or_default();
        let payload = String::from_utf8_lossy(message.payload().unwrap_or_default());
        let key = String::from_utf8_lossy(message.key().unwrap_or_default());
        if placed.iter().any(|id| id.to_string() == key) {
            seen += 1;
            println!(
                "kafka: {} key={key} event_id={event_id} {payload}",
                message.topic()
            );
        }
    }

    let status = relay.status().await?;
    println!(
        "outbox: {} unpublished, {} parked; shutting the relay down",
        status.unpublished, status.parked
    );
    cancel.cancel();
    relay_task.await??;
    Ok(())
}
