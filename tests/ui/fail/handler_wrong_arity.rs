use outbox_runtime::inbox::HandlerError;
use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "payment.events", aggregate_type = "Payment")]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    payment_id: u64,
}

#[outbox_runtime::inbox_handler]
async fn only_event(event: PaymentSucceeded) -> Result<(), HandlerError> {
    let _ = event;
    Ok(())
}

#[outbox_runtime::inbox_handler]
async fn three(event: PaymentSucceeded, tx: &mut sqlx::PgConnection, extra: u8) -> Result<(), HandlerError> {
    let _ = (event, tx, extra);
    Ok(())
}

fn main() {}
