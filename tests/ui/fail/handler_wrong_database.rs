//! A handler of one database is not a handler of a consumer on the other.
use outbox_runtime::inbox::{Handler, HandlerError};
use outbox_runtime::OutboxEvent;
use sqlx::{MySql, MySqlConnection, PgConnection};

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
pub struct OrderCreated {
    #[outbox(aggregate_id)]
    pub order_id: u64,
}

#[outbox_runtime::inbox_handler]
async fn on_mysql(event: OrderCreated, tx: &mut MySqlConnection) -> Result<(), HandlerError> {
    let _ = (event, tx);
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn on_postgres(event: OrderCreated, tx: &mut PgConnection) -> Result<(), HandlerError> {
    let _ = (event, tx);
    Ok(())
}

/// The bound `ConsumerBuilder::<S, D>::handler` puts on its argument, on PostgreSQL.
fn register_pg<H: Handler<()>>(_handler: H) {}
/// The same, on MariaDB/MySQL.
fn register_mysql<H: Handler<(), MySql>>(_handler: H) {}

fn main() {
    register_pg(on_mysql);
    register_mysql(on_postgres);
}
