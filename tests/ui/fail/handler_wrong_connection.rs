use outbox_runtime::inbox::HandlerError;
use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "payment.events", aggregate_type = "Payment")]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    payment_id: u64,
}

#[outbox_runtime::inbox_handler]
async fn by_pool(event: PaymentSucceeded, pool: sqlx::PgPool) -> Result<(), HandlerError> {
    let _ = (event, pool);
    Ok(())
}

fn main() {}
