use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
struct OrderCreated {
    #[outbox(event_id)]
    id: String,
    #[outbox(aggregate_id)]
    order_id: u64,
}

fn main() {}
