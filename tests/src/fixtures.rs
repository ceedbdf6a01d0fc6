//! Events, a domain table and handlers shared by the consumer tests and their helper process.

use std::collections::BTreeMap;
use std::sync::Mutex;

use outbox_runtime::inbox::HandlerError;
use outbox_runtime::{inbox_handler, OutboxEvent};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

pub const PAYMENTS: &str = "payment.events";

/// A ledger posting with its own event id (so a test knows it before the emit), for the tests
/// of errors and headers.
#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(topic = "ledger.events", aggregate_type = "Ledger")]
pub struct Posted {
    #[outbox(aggregate_id)]
    pub ledger: String,
    #[outbox(event_id)]
    pub id: Uuid,
}

/// A posting to `ledger` with a fresh event id.
pub fn posted(ledger: &str) -> Posted {
    Posted {
        ledger: ledger.to_owned(),
        id: Uuid::now_v7(),
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(
    topic = "payment.events",
    aggregate_type = "Payment",
    event_type = "PaymentSucceeded"
)]
pub struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    pub payment_id: Uuid,
    pub order_id: Uuid,
    pub amount: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(
    topic = "payment.events",
    aggregate_type = "Payment",
    event_type = "PaymentRefunded"
)]
pub struct PaymentRefunded {
    #[outbox(aggregate_id)]
    pub payment_id: Uuid,
    pub order_id: Uuid,
}

/// The order event of the emit tests and benchmark.
#[derive(Debug, Clone, Serialize, OutboxEvent)]
#[outbox(
    topic = "order.events",
    aggregate_type = "Order",
    event_type = "OrderCreated"
)]
pub struct OrderCreated {
    #[outbox(aggregate_id)]
    pub order_id: Uuid,
    pub customer_id: Uuid,
    pub amount: i64,
}

/// The domain table: `paid` counts how often a payment was applied, so a duplicate shows.
pub async fn create_orders(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE orders (id uuid PRIMARY KEY, payment_status text NOT NULL DEFAULT 'new', \
         paid integer NOT NULL DEFAULT 0, refunded integer NOT NULL DEFAULT 0)",
    )
    .execute(pool)
    .await
    .expect("orders table");
}

pub async fn insert_orders(pool: &PgPool, ids: &[Uuid]) {
    sqlx::query("INSERT INTO orders (id) SELECT unnest($1::uuid[])")
        .bind(ids)
        .execute(pool)
        .await
        .expect("orders");
}

/// Marks the order paid. A negative amount is a permanent failure.
#[inbox_handler]
pub async fn mark_order_paid(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    if event.amount < 0 {
        return Err(HandlerError::permanent(format!(
            "negative amount {}",
            event.amount
        )));
    }
    sqlx::query("UPDATE orders SET payment_status = 'paid', paid = paid + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    Ok(())
}

/// Calls of [`flaky_mark_paid`] so far, by order.
pub static FLAKY_CALLS: Mutex<BTreeMap<Uuid, u32>> = Mutex::new(BTreeMap::new());

pub fn flaky_calls(order: Uuid) -> u32 {
    FLAKY_CALLS
        .lock()
        .unwrap()
        .get(&order)
        .copied()
        .unwrap_or(0)
}

/// Fails (retryably) on its first two calls for an order, then marks the order paid.
#[inbox_handler(name = "flaky_mark_paid")]
pub async fn flaky_mark_paid(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    // The write happens before the failure, to show that a failed attempt leaves nothing.
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(&mut *tx)
        .await?;
    let calls = {
        let mut calls = FLAKY_CALLS.lock().unwrap();
        let n = calls.entry(event.order_id).or_default();
        *n += 1;
        *n
    };
    if calls <= 2 {
        return Err(HandlerError::retryable("the payment service is busy"));
    }
    Ok(())
}

/// Closed until a test adds permits: [`gated_mark_paid`] waits for one per event.
pub static GATE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);

/// Marks the order paid once the gate lets it: a handler slower than any burst.
#[inbox_handler]
pub async fn gated_mark_paid(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    GATE.acquire()
        .await
        .map_err(HandlerError::permanent)?
        .forget();
    sqlx::query("UPDATE orders SET payment_status = 'paid', paid = paid + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    Ok(())
}

/// The payments ledger of the aborted-transaction tests: one row per order.
pub async fn create_ledger(pool: &PgPool) {
    sqlx::query("CREATE TABLE ledger (order_id uuid PRIMARY KEY, amount bigint NOT NULL)")
        .execute(pool)
        .await
        .expect("ledger table");
}

/// Records the payment; "already recorded" is fine, so the unique violation is swallowed, as
/// application code often does, without a savepoint: it leaves the transaction aborted.
#[inbox_handler]
pub async fn record_payment_swallowing_duplicates(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    let inserted = sqlx::query("INSERT INTO ledger (order_id, amount) VALUES ($1, $2)")
        .bind(event.order_id)
        .bind(event.amount)
        .execute(&mut *tx)
        .await;
    match inserted {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Calls of [`panicky_mark_paid`] so far, by order.
pub static PANICKY_CALLS: Mutex<BTreeMap<Uuid, u32>> = Mutex::new(BTreeMap::new());

/// Panics on its first call for an order whose amount is 13, then marks it paid; marks the
/// others paid at once.
#[inbox_handler]
pub async fn panicky_mark_paid(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    let calls = {
        let mut calls = PANICKY_CALLS.lock().unwrap();
        let n = calls.entry(event.order_id).or_default();
        *n += 1;
        *n
    };
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(&mut *tx)
        .await?;
    if event.amount == 13 && calls == 1 {
        panic!(
            "the payment provider's client panicked for order {}",
            event.order_id
        );
    }
    Ok(())
}

/// Orders [`sometimes_failing_mark_paid`] handled, in the order it handled them.
pub static HANDLED: Mutex<Vec<Uuid>> = Mutex::new(Vec::new());

/// Fails (retryably) on its first two calls for an order whose amount is 7, then marks it
/// paid; marks the others paid at once. Records what it handled, in order.
#[inbox_handler]
pub async fn sometimes_failing_mark_paid(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    if event.amount == 7 {
        let calls = {
            let mut calls = FLAKY_CALLS.lock().unwrap();
            let n = calls.entry(event.order_id).or_default();
            *n += 1;
            *n
        };
        if calls <= 2 {
            return Err(HandlerError::retryable("the payment service is busy"));
        }
    }
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(&mut *tx)
        .await?;
    HANDLED.lock().unwrap().push(event.order_id);
    Ok(())
}

/// Receipts, one per order, checked at commit (a deferred unique constraint).
pub async fn create_receipts(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE receipt (order_id uuid NOT NULL, \
         CONSTRAINT one_receipt_per_order UNIQUE (order_id) DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(pool)
    .await
    .expect("receipt table");
}

/// Writes the order's receipt, twice when the amount is 9: every statement succeeds, and the
/// transaction is refused at commit.
#[inbox_handler]
pub async fn write_receipt(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    let copies = if event.amount == 9 { 2 } else { 1 };
    for _ in 0..copies {
        sqlx::query("INSERT INTO receipt (order_id) VALUES ($1)")
            .bind(event.order_id)
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// Records the payment in the ledger: a second run for one order would fail (its primary
/// key), so the ledger shows each payment's effect exactly once.
#[inbox_handler]
pub async fn record_payment(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO ledger (order_id, amount) VALUES ($1, $2)")
        .bind(event.order_id)
        .bind(event.amount)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Dedup records of every age, for retention tests: 45 `inbox_event` rows received 41 days ago,
/// of which 30 processed 40 days ago, 10 unprocessed and 5 dead; 55 `processed_event` rows, 40
/// of them processed 31 days ago and 15 29 days ago.
pub async fn insert_dedup_records(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO inbox_event (event_id, topic, event_type, payload, processed, processed_at, \
             dead_at, received_at) \
         SELECT gen_random_uuid(), 't', 'E', '{}', i <= 30, \
             CASE WHEN i <= 30 THEN now() - interval '40 days' END, \
             CASE WHEN i > 40 THEN now() - interval '40 days' END, now() - interval '41 days' \
         FROM generate_series(1, 45) AS i",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO processed_event (event_id, handler, processed_at) \
         SELECT gen_random_uuid(), 'h', \
             now() - make_interval(days => CASE WHEN i <= 40 THEN 31 ELSE 29 END) \
         FROM generate_series(1, 55) AS i",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// Gives a new installation's `processed_event` (still empty) partitions `days` back: its
/// partitions are dropped and made again from the width that held that moment on (the first
/// partition taking everything before), as if the installation were that old.
pub async fn dedup_partitions_since(pool: &PgPool, days: u32) {
    partitions_since(pool, "processed_event", days).await;
}

/// Gives a new installation's (still empty, partitioned) outbox daily partitions from `days`
/// back (as a retention of that many days leaves them) to three days ahead.
pub async fn partitioned_outbox(pool: &PgPool, days: u32) {
    partitions_since(pool, "outbox_event", days).await;
}

/// Gives `table` (partitioned, still empty) partitions `width` wide and an hour ahead, from
/// `since` (an SQL timestamp expression) on: its partitions are dropped and made again.
pub async fn narrow_partitions(
    pool: &PgPool,
    table: outbox_runtime::admin::CleanupTable,
    width: std::time::Duration,
    since: &str,
) {
    outbox_runtime::admin::set_partitioning(
        pool,
        table,
        width,
        std::time::Duration::from_secs(3600),
    )
    .await
    .expect("partitioning");
    drop_partitions_of(pool, table.table_name(), "true").await;
    sqlx::query(&format!(
        "SELECT outbox_create_partitions(to_regclass($1), {since})"
    ))
    .bind(table.table_name())
    .execute(pool)
    .await
    .unwrap();
}

/// [`dedup_partitions_since`] for any partitioned table (`inbox_event`, say).
pub async fn partitions_since(pool: &PgPool, table: &str, days: u32) {
    drop_partitions_of(pool, table, "true").await;
    sqlx::query(
        "SELECT outbox_create_partitions(to_regclass($1), now() - make_interval(days => $2))",
    )
    .bind(table)
    .bind(days as i32)
    .execute(pool)
    .await
    .unwrap();
}

/// Drops the `processed_event` partitions that `filter` (on `outbox_partitions`' columns)
/// picks, as a careless operator would.
pub async fn drop_dedup_partitions(pool: &PgPool, filter: &str) {
    drop_partitions_of(pool, "processed_event", filter).await;
}

/// [`drop_dedup_partitions`] for any partitioned table.
pub async fn drop_partitions_of(pool: &PgPool, table: &str, filter: &str) {
    sqlx::raw_sql(&format!(
        "DO $$ DECLARE p regclass; BEGIN \
           FOR p IN SELECT partition FROM outbox_partitions('{table}') \
                    WHERE {filter} LOOP \
             EXECUTE format('DROP TABLE %s', p); \
           END LOOP; \
         END $$"
    ))
    .execute(pool)
    .await
    .unwrap();
}
