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

// The same, declared by a `macro_rules!` that takes the connection as a `ty` fragment: the
// error points at the type the macro was given.
macro_rules! handler_taking {
    ($conn:ty) => {
        #[outbox_runtime::inbox_handler]
        async fn by_pool_in_a_macro(event: PaymentSucceeded, pool: $conn) -> Result<(), HandlerError> {
            let _ = (event, pool);
            Ok(())
        }
    };
}
handler_taking!(sqlx::PgPool);

fn main() {}
