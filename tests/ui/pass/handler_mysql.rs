//! A handler that takes `&mut MySqlConnection` is a handler of consumers on MariaDB/MySQL.
use outbox_runtime::inbox::{Handler, HandlerError, MessageMeta};
use outbox_runtime::OutboxEvent;
use sqlx::{MySql, MySqlConnection};

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
pub struct OrderCreated {
    #[outbox(aggregate_id)]
    pub order_id: u64,
}

pub struct Payments;

#[outbox_runtime::inbox_handler]
async fn ship(event: OrderCreated, tx: &mut MySqlConnection) -> Result<(), HandlerError> {
    sqlx::query("UPDATE orders SET shipped = 1 WHERE id = ?")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn charge(
    event: OrderCreated,
    tx: &mut sqlx::MySqlConnection,
    meta: &MessageMeta,
    payments: &Payments,
) -> Result<(), HandlerError> {
    let _ = (event, tx, meta, payments);
    Ok(())
}

fn register<S, H: Handler<S, MySql>>(_state: &S, _handler: H) {}

fn main() {
    register(&(), ship);
    register(&Payments, ship);
    register(&Payments, charge);
}
