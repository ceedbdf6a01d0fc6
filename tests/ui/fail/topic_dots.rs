use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "..", aggregate_type = "Order")]
struct OrderCreated {
    #[outbox(aggregate_id)]
    order_id: u64,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "", aggregate_type = "Order")]
struct OrderPaid {
    #[outbox(aggregate_id)]
    order_id: u64,
}

fn main() {}
