use outbox_runtime::OutboxEvent;
use uuid::Uuid;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order", event_type = "OrderCreated")]
struct OrderCreated {
    #[outbox(aggregate_id)]
    order_id: Uuid,
    customer_id: Uuid,
    amount: i64,
}

fn main() {
    let id = Uuid::now_v7();
    let event = OrderCreated { order_id: id, customer_id: Uuid::nil(), amount: 5 };
    assert_eq!(OrderCreated::TOPIC, "order.events");
    assert_eq!(event.topic(), "order.events");
    assert_eq!(event.aggregate_type(), "Order");
    assert_eq!(event.event_type(), "OrderCreated");
    assert_eq!(event.aggregate_id(), id.to_string());
    assert_eq!(event.partition_key(), id.to_string());
    assert_eq!(event.event_id(), None);
    assert_eq!(event.payload().unwrap()["amount"], 5);
}
