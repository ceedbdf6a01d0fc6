//! The parameters after the connection: `&State` and `&MessageMeta`, each at most once.
use outbox_runtime::inbox::{HandlerError, MessageMeta};
use outbox_runtime::OutboxEvent;
use sqlx::PgConnection;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
pub struct OrderCreated {
    #[outbox(aggregate_id)]
    pub order_id: u64,
}

pub struct Payments;

#[outbox_runtime::inbox_handler]
async fn state_by_value(event: OrderCreated, tx: &mut PgConnection, payments: Payments) -> Result<(), HandlerError> {
    let _ = (event, tx, payments);
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn state_mut(event: OrderCreated, tx: &mut PgConnection, payments: &mut Payments) -> Result<(), HandlerError> {
    let _ = (event, tx, payments);
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn two_states(event: OrderCreated, tx: &mut PgConnection, a: &Payments, b: &String) -> Result<(), HandlerError> {
    let _ = (event, tx, a, b);
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn two_metas(event: OrderCreated, tx: &mut PgConnection, a: &MessageMeta<'_>, b: &MessageMeta<'_>) -> Result<(), HandlerError> {
    let _ = (event, tx, a, b);
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn meta_by_value(event: OrderCreated, tx: &mut PgConnection, meta: MessageMeta<'static>) -> Result<(), HandlerError> {
    let _ = (event, tx, meta);
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn meta_mut(event: OrderCreated, tx: &mut PgConnection, meta: &mut MessageMeta<'_>) -> Result<(), HandlerError> {
    let _ = (event, tx, meta);
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn five(event: OrderCreated, tx: &mut PgConnection, a: &Payments, m: &MessageMeta<'_>, extra: &u8) -> Result<(), HandlerError> {
    let _ = (event, tx, a, m, extra);
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn event_by_reference(event: &OrderCreated, tx: &mut PgConnection) -> Result<(), HandlerError> {
    let _ = (event, tx);
    Ok(())
}

fn main() {}
