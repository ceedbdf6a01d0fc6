// The generated code passes the strictest lints.
#![deny(warnings, unused_qualifications, missing_docs, clippy::all, clippy::pedantic)]
//! Lint check.

use outbox_runtime::OutboxEvent;

/// An event.
#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
pub struct OrderCreated {
    /// The order.
    #[outbox(aggregate_id)]
    pub order_id: u64,
}

fn main() {
    let _ = OrderCreated { order_id: 1 }.aggregate_id();
}
