use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
#[outbox(topic = "order.events.v2")]
struct OrderCreated {
    #[outbox(aggregate_id, aggregate_id)]
    order_id: u64,
}

fn main() {}
