use outbox_runtime::inbox::HandlerError;

#[derive(serde::Deserialize)]
struct NotAnEvent {
    id: u64,
}

#[derive(serde::Serialize, outbox_runtime::OutboxEvent)]
#[outbox(topic = "payment.events", aggregate_type = "Payment")]
struct NotDeserializable {
    #[outbox(aggregate_id)]
    id: u64,
}

#[outbox_runtime::inbox_handler]
async fn handle_plain(event: NotAnEvent, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
    let _ = (event.id, tx);
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn handle_serialize_only(event: NotDeserializable, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
    let _ = (event, tx);
    Ok(())
}

fn main() {}
