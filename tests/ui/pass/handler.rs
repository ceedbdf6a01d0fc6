use outbox_runtime::inbox::{Handler, HandlerError};
use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "payment.events", aggregate_type = "Payment", event_type = "PaymentSucceeded")]
pub struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    pub payment_id: u64,
}

mod handlers {
    use super::*;

    /// Marks the order paid.
    #[outbox_runtime::inbox_handler]
    pub async fn mark_paid(event: PaymentSucceeded, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
        sqlx::query("SELECT $1").bind(event.payment_id as i64).execute(tx).await?;
        Ok(())
    }

    #[outbox_runtime::inbox_handler(name = "billing.v2")]
    pub(crate) async fn bill(_event: PaymentSucceeded, _tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
        Err(HandlerError::retryable("later"))
    }
}

fn dedup_key<H: Handler<Event = PaymentSucceeded>>(handler: H) -> String {
    assert!(!handler.name().is_empty());
    handler.dedup_key("orders")
}

fn main() {
    // Visible outside its module, named after the function (or `name = ...`, which is the
    // deduplication key as it stands).
    assert_eq!(handlers::mark_paid.name(), "mark_paid");
    assert_eq!(dedup_key(handlers::mark_paid), "orders/mark_paid");
    assert_eq!(handlers::bill.name(), "billing.v2");
    assert_eq!(dedup_key(handlers::bill), "billing.v2");
}
