use outbox_runtime::OutboxEvent;

#[derive(OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
union OrderId {
    number: u64,
    bytes: [u8; 8],
}

fn main() {}
