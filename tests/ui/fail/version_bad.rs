use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "t", aggregate_type = "A", version = 0)]
struct Zero {
    #[outbox(aggregate_id)]
    id: u64,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "t", aggregate_type = "A", version = "2")]
struct Text {
    #[outbox(aggregate_id)]
    id: u64,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "t", aggregate_type = "A", version = -1)]
struct Negative {
    #[outbox(aggregate_id)]
    id: u64,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "t", aggregate_type = "A", version = 2u8)]
struct Suffixed {
    #[outbox(aggregate_id)]
    id: u64,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "t", aggregate_type = "A", version = 4294967296)]
struct TooBig {
    #[outbox(aggregate_id)]
    id: u64,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "t", aggregate_type = "A", version = 2, version = 3)]
struct Twice {
    #[outbox(aggregate_id)]
    id: u64,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "t", aggregate_type = "A", version)]
struct NoValue {
    #[outbox(aggregate_id)]
    id: u64,
}

fn main() {}
