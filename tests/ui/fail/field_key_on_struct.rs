use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order", key)]
struct OrderCreated {
    #[outbox(aggregate_id, topic = "x")]
    order_id: u64,
}

fn main() {}
