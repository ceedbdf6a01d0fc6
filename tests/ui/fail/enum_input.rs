use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
enum OrderEvent {
    Created { order_id: u64 },
    Paid { order_id: u64 },
}

fn main() {}
