use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = order_events, aggregate_type = 5, event_type)]
struct OrderCreated {
    #[outbox(aggregate_id = "order_id")]
    order_id: u64,
}

fn main() {}
