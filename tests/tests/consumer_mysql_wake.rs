//! A dedup consumer's batch on MariaDB whose handler emits (`mysql::emit`) wakes the relays of
//! its process when it commits, as a unit of work does: they do not wait for their next poll.
//! (Its own test binary: the signal is process-wide, and no other test may bump it meanwhile.)

use std::time::Duration;

use outbox_runtime::inbox::{Consumer, HandlerError};
use outbox_runtime::inbox_handler;
use outbox_tests::fixtures::{PaymentSucceeded, PAYMENTS};
use outbox_tests::kafka::{produce, Outgoing};
use outbox_tests::mysql::{count, payments_setup};
use outbox_tests::payments::wait_for;
use outbox_tests::Running;
use sqlx::MySqlConnection;
use uuid::Uuid;

#[derive(serde::Serialize, outbox_runtime::OutboxEvent)]
#[outbox(
    topic = "shipping.events",
    aggregate_type = "Order",
    event_type = "ShipOrder"
)]
struct ShipOrder {
    #[outbox(aggregate_id)]
    order_id: Uuid,
}

/// Emits the next step in the consumer's transaction.
#[inbox_handler]
async fn ship(event: PaymentSucceeded, tx: &mut MySqlConnection) -> Result<(), HandlerError> {
    outbox_runtime::mysql::emit(
        tx,
        &ShipOrder {
            order_id: event.order_id,
        },
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_ran_handlers_wakes_the_relays_of_its_process() {
    let (db, kafka) = payments_setup().await;
    let records: Vec<Outgoing> = (0..5)
        .map(|_| {
            let event = PaymentSucceeded {
                payment_id: Uuid::now_v7(),
                order_id: Uuid::now_v7(),
                amount: 100,
            };
            Outgoing::event(&event, Uuid::now_v7())
        })
        .collect();
    let before = outbox_runtime::mysql::relay_wakeups();
    produce(&kafka.bootstrap(), PAYMENTS, &records).await;
    let consumer = Consumer::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .group_id("shipping")
        .handler(ship)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for("every payment handled", Duration::from_secs(60), || async {
        count(&db.pool, "SELECT COUNT(*) FROM outbox_event").await == 5
    })
    .await;
    running.stop().await;
    assert!(
        outbox_runtime::mysql::relay_wakeups() > before,
        "the relays were never signalled"
    );
}
