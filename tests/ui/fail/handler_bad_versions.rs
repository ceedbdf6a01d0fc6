use outbox_runtime::inbox::HandlerError;
use outbox_runtime::{inbox_handler, OutboxEvent};
use sqlx::PgConnection;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order", version = 2)]
struct OrderCreated {
    #[outbox(aggregate_id)]
    order_id: u64,
}

#[inbox_handler(versions = [])]
async fn empty(_event: OrderCreated, _tx: &mut PgConnection) -> Result<(), HandlerError> {
    Ok(())
}

#[inbox_handler(versions = [0, 2, 2, "3", 4i64])]
async fn bad_entries(_event: OrderCreated, _tx: &mut PgConnection) -> Result<(), HandlerError> {
    Ok(())
}

#[inbox_handler(versions = 2)]
async fn not_a_list(_event: OrderCreated, _tx: &mut PgConnection) -> Result<(), HandlerError> {
    Ok(())
}

// Version 2 is the event's own: a handler that lists versions lists it.
#[inbox_handler(versions = [1])]
async fn without_its_own(_event: OrderCreated, _tx: &mut PgConnection) -> Result<(), HandlerError> {
    Ok(())
}

// The same, declared by a `macro_rules!` that takes the event as a `ty` fragment: the message
// names the type as written.
macro_rules! without_its_own_in_a_macro {
    ($event:ty) => {
        #[inbox_handler(versions = [1])]
        async fn in_a_macro(_event: $event, _tx: &mut PgConnection) -> Result<(), HandlerError> {
            Ok(())
        }
    };
}
without_its_own_in_a_macro!(OrderCreated);

fn main() {}
