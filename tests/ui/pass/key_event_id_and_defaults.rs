use outbox_runtime::OutboxEvent;
use uuid::Uuid;

/// `event_type` defaults to the struct's name; a `key` field overrides the partition key;
/// serde attributes shape the payload; several `#[outbox]` attributes merge.
#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "customer-events_v2", aggregate_type = "Customer")]
#[serde(rename_all = "camelCase")]
struct CustomerMoved {
    #[outbox(event_id)]
    id: Uuid,
    #[outbox(aggregate_id)]
    customer_number: u32,
    #[outbox(key)]
    region_code: String,
    #[serde(skip)]
    #[allow(dead_code)]
    internal: (),
}

fn main() {
    let id = Uuid::new_v4();
    let event = CustomerMoved { id, customer_number: 42, region_code: "eu-1".into(), internal: () };
    assert_eq!(CustomerMoved::EVENT_TYPE, "CustomerMoved");
    assert_eq!(event.aggregate_id(), "42");
    assert_eq!(event.partition_key(), "eu-1");
    assert_eq!(event.event_id(), Some(id));
    assert_eq!(event.payload().unwrap()["regionCode"], "eu-1");
}
