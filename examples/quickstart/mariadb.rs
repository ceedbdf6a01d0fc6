//! The same two services on MariaDB or MySQL (`--database mariadb`): the same events, the
//! same unit of work and the same handlers, with the differences the database makes and no
//! other:
//!
//! - the SQL's placeholders are `?`, and a UUID is stored as `BINARY(16)`;
//! - a handler takes `&mut sqlx::MySqlConnection`, and emits with `outbox_runtime::mysql::emit`;
//! - the orders consumer runs in dedup mode (the default): inbox mode is not built on MariaDB
//!   yet, so `Mode::Inbox` would be refused at `build`.
//!
//! The relays and the wiring are `main.rs`'s: `Relay::builder` takes a `MySqlPool` as it takes
//! a `PgPool`, and `Consumer::builder(mysql_pool)` takes handlers of MySQL connections.

use outbox_runtime::inbox::{HandlerError, MessageMeta};
use outbox_runtime::{inbox_handler, Uow};
use sqlx::{MySqlConnection, MySqlPool};
use tracing::Instrument as _;
use uuid::Uuid;

use crate::support;
use crate::support::latency::Handler;
use crate::{NewOrder, OrderCreated, PaymentSucceeded, Payments};

/// The command: the order row and its `OrderCreated` event commit together, or neither does.
pub(crate) async fn place_order(db: &MySqlPool, order: NewOrder) -> outbox_runtime::Result<Uuid> {
    let order_id = Uuid::now_v7();
    let mut uow = Uow::begin(db).await?;
    sqlx::query("INSERT INTO orders (id, customer_id, product_id, amount) VALUES (?, ?, ?, ?)")
        .bind(order_id)
        .bind(&order.customer_id)
        .bind(&order.product_id)
        .bind(order.amount)
        .execute(uow.tx())
        .await?;
    uow.emit(&OrderCreated {
        order_id,
        customer_id: order.customer_id,
        product_id: order.product_id,
        amount: order.amount,
    })
    .await?;
    uow.commit().await?;
    support::latency::committed(order_id); // for the demo's report
    Ok(order_id)
}

/// The order's customer, product, amount and payment status, if there is such an order.
pub(crate) async fn find_order(
    db: &MySqlPool,
    order_id: Uuid,
) -> sqlx::Result<Option<(String, String, i64, String)>> {
    sqlx::query_as(
        "SELECT customer_id, product_id, amount, payment_status FROM orders WHERE id = ?",
    )
    .bind(order_id)
    .fetch_optional(db)
    .await
}

/// The orders service learns of payments, in the orders consumer's transaction with its
/// deduplication row (dedup mode on MariaDB).
#[inbox_handler]
pub(crate) async fn mark_order_paid(
    event: PaymentSucceeded,
    tx: &mut MySqlConnection,
) -> Result<(), HandlerError> {
    support::latency::handled(Handler::Orders, event.order_id); // for the demo's report
                                                                // Rows matched, not only changed (sqlx asks MariaDB for found rows).
    let updated = sqlx::query("UPDATE orders SET payment_status = 'paid' WHERE id = ?")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    if updated.rows_affected() == 0 {
        // Retrying cannot help: the message goes to the dead-letter topic.
        let message = format!("payment for unknown order {}", event.order_id);
        return Err(HandlerError::permanent(message));
    }
    Ok(())
}

/// Charges an order, as `main.rs`'s `charge_order` does: the provider's call made idempotent
/// with the event's id, the payment row and its `PaymentSucceeded` event in the consumer's
/// transaction with its deduplication row.
#[inbox_handler]
pub(crate) async fn charge_order(
    event: OrderCreated,
    tx: &mut MySqlConnection,
    payments: &Payments,
    meta: &MessageMeta,
) -> Result<(), HandlerError> {
    support::latency::handled(Handler::Payments, event.order_id); // for the demo's report
    let charge = payments
        .provider
        .charge(meta.event_id(), event.amount)
        .instrument(tracing::info_span!(
            "provider_charge",
            attempt = meta.attempt()
        ))
        .await
        .map_err(HandlerError::retryable)?;
    let payment_id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO payments (id, order_id, amount, provider_charge, attempt) \
         VALUES (?, ?, ?, ?, ?)",
    )
    .bind(payment_id)
    .bind(event.order_id)
    .bind(event.amount)
    .bind(charge)
    .bind(meta.attempt() as i32)
    .execute(&mut *tx)
    .await?;
    let succeeded = PaymentSucceeded {
        payment_id,
        order_id: event.order_id,
        amount: event.amount,
    };
    outbox_runtime::mysql::emit(tx, &succeeded).await?;
    Ok(())
}
