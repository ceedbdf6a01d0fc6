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

fn takes_handler<H: Handler<Event = PaymentSucceeded>>(_: H) -> &'static str {
    H::NAME
}

fn main() {
    // Visible outside its module, named after the function (or `name = ...`).
    assert_eq!(takes_handler(handlers::mark_paid), "mark_paid");
    assert_eq!(takes_handler(handlers::bill), "billing.v2");
}
