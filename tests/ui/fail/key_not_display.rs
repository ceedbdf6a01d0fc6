use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize)]
struct CustomerRef {
    id: u64,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
struct OrderCreated {
    #[outbox(aggregate_id)]
    order_id: u64,
    #[outbox(key)]
    customer: CustomerRef,
}

fn main() {}
