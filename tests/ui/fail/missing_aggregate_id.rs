use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
struct OrderCreated {
    #[outbox(key)]
    order_id: u64,
}

fn main() {}
