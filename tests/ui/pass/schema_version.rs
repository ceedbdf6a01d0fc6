use outbox_runtime::inbox::{Handler, HandlerError};
use outbox_runtime::{inbox_handler, OutboxEvent};
use sqlx::PgConnection;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order", version = 3)]
struct OrderCreated {
    #[outbox(aggregate_id)]
    order_id: u64,
    #[serde(default)]
    note: String,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order", version = 7u32)]
struct Suffixed {
    #[outbox(aggregate_id)]
    order_id: u64,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
struct Unversioned {
    #[outbox(aggregate_id)]
    order_id: u64,
}

#[inbox_handler(versions = [2, 3])]
async fn created(_event: OrderCreated, _tx: &mut PgConnection) -> Result<(), HandlerError> {
    Ok(())
}

#[inbox_handler]
async fn created_latest(_event: OrderCreated, _tx: &mut PgConnection) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {
    const _: () = assert!(OrderCreated::SCHEMA_VERSION == 3);
    const _: () = assert!(Suffixed::SCHEMA_VERSION == 7);
    const _: () = assert!(Unversioned::SCHEMA_VERSION == 1);
    assert!(Handler::<()>::accepts_version(&created, 2));
    assert!(!Handler::<()>::accepts_version(&created, 1));
    assert!(Handler::<()>::accepts_version(&created_latest, 3));
    assert!(!Handler::<()>::accepts_version(&created_latest, 2));
}
