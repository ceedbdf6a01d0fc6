//! A handler that takes `&Payments` is a handler of consumers whose state is `Payments` only.
use outbox_runtime::inbox::{Handler, HandlerError};
use outbox_runtime::OutboxEvent;
use sqlx::PgConnection;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
pub struct OrderCreated {
    #[outbox(aggregate_id)]
    pub order_id: u64,
}

pub struct Payments;
pub struct Inventory;

#[outbox_runtime::inbox_handler]
async fn charge(event: OrderCreated, tx: &mut PgConnection, payments: &Payments) -> Result<(), HandlerError> {
    let _ = (event, tx, payments);
    Ok(())
}

/// The bound `ConsumerBuilder::<S>::handler` puts on its argument.
fn register<S, H: Handler<S>>(_state: &S, _handler: H) {}

fn main() {
    register(&Inventory, charge);
    // A consumer without state (`.state(...)` not called, or called after `.handler(...)`).
    register(&(), charge);
}
