use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(aggregate_type = "Order")]
struct OrderCreated {
    #[outbox(aggregate_id)]
    order_id: u64,
}

fn main() {}
