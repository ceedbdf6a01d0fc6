use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
struct OrderCreated {
    #[outbox(aggregate_id)]
    order_id: u64,
    #[outbox(aggregate_id)]
    customer_id: u64,
}

fn main() {}
