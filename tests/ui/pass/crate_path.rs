// A crate that re-exports outbox_runtime under another name points the derive at it.
mod framework {
    pub use outbox_runtime as outbox;
}

use framework::outbox::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order", crate = "framework::outbox")]
struct OrderCreated {
    #[outbox(aggregate_id)]
    order_id: u64,
}

fn main() {
    assert_eq!(OrderCreated { order_id: 3 }.partition_key(), "3");
}
