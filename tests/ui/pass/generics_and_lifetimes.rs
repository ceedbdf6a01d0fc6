use std::fmt::Display;

use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "audit", aggregate_type = "Document", event_type = "DocumentTagged")]
struct Tagged<'a, Id: Display + serde::Serialize> {
    #[outbox(aggregate_id)]
    document: Id,
    tag: &'a str,
}

fn main() {
    let event = Tagged { document: 7u8, tag: "x" };
    assert_eq!(event.aggregate_id(), "7");
    assert_eq!(Tagged::<'static, u64>::EVENT_TYPE, "DocumentTagged");
}
