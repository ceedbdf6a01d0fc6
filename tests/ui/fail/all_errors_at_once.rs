use outbox_runtime::OutboxEvent;

// Every problem is reported in one compile, not one per fix.
#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "bad topic", event_typ = "OrderCreated")]
struct OrderCreated {
    #[outbox(key)]
    order_id: u64,
    #[outbox(key, id)]
    customer_id: u64,
}

fn main() {}
