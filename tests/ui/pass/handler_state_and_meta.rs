//! Handlers that take the consumer's state and the message's metadata, in either order, and
//! handlers that take neither, which work with any state.
use outbox_runtime::inbox::{Handler, HandlerError, MessageMeta};
use outbox_runtime::OutboxEvent;
use sqlx::PgConnection;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
pub struct OrderCreated {
    #[outbox(aggregate_id)]
    pub order_id: u64,
}

pub struct Payments {
    pub url: String,
}

#[outbox_runtime::inbox_handler]
async fn charge(
    event: OrderCreated,
    tx: &mut PgConnection,
    payments: &Payments,
    meta: &MessageMeta<'_>,
) -> Result<(), HandlerError> {
    let _ = (event.order_id, tx, payments.url.len(), meta.attempt(), meta.header("tenant"));
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn meta_first(
    event: OrderCreated,
    tx: &mut PgConnection,
    meta: &MessageMeta,
    payments: &Payments,
) -> Result<(), HandlerError> {
    let _ = (event, tx, meta.event_id(), payments);
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn meta_only(event: OrderCreated, tx: &mut PgConnection, meta: &MessageMeta<'_>) -> Result<(), HandlerError> {
    let _ = (event, tx, meta.topic(), meta.partition(), meta.offset(), meta.key());
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn plain(event: OrderCreated, tx: &mut PgConnection) -> Result<(), HandlerError> {
    let _ = (event, tx);
    Ok(())
}

/// The bound `ConsumerBuilder::<S>::handler` puts on its argument.
fn register<S, H: Handler<S>>(_state: &S, handler: H) -> String {
    handler.name().to_owned()
}

fn main() {
    let payments = Payments { url: String::new() };
    assert_eq!(register(&payments, charge), "charge");
    assert_eq!(register(&payments, meta_first), "meta_first");
    // Without state: a handler of any consumer.
    assert_eq!(register(&payments, meta_only), "meta_only");
    assert_eq!(register(&(), plain), "plain");
    assert_eq!(register(&7_u8, plain), "plain");
}
