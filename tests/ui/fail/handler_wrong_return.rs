use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "payment.events", aggregate_type = "Payment")]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    payment_id: u64,
}

#[outbox_runtime::inbox_handler]
async fn returns_nothing(event: PaymentSucceeded, tx: &mut sqlx::PgConnection) {
    let _ = (event, tx);
}

#[outbox_runtime::inbox_handler]
async fn returns_sqlx_result(event: PaymentSucceeded, tx: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    let _ = (event, tx);
    Ok(())
}

fn main() {}
