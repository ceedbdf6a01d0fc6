use outbox_runtime::inbox::HandlerError;
use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "payment.events", aggregate_type = "Payment")]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    payment_id: u64,
}

#[outbox_runtime::inbox_handler]
fn mark_paid(event: PaymentSucceeded, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
    let _ = (event, tx);
    Ok(())
}

fn main() {}
