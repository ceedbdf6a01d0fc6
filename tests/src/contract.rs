//! What the consumer suites run on each database share: [`payments_kit!`](crate::payments_kit)
//! declares, in the module that invokes it, the payments' helpers and handlers for one
//! database, so that one suite (a `macro_rules!` in its test file, instantiated per database)
//! runs the same scenarios with the same handlers on PostgreSQL and on MariaDB.

/// Declares, for the database of test database type `$db` (a `pool` field), connection type
/// `$conn` and first bound parameter `$p1` (`"$1"`, `"?"`): `Database`; `orders_with_payments`,
/// `plain_payments`, `paid`, `marked` (the dedup rows of a handler); the handlers `mark_paid`
/// (a negative amount fails for good), `mark_refunded`, `mark_paid_counted` (the handler of
/// `stopping`'s drill), `flaky` (pays, then fails its first two calls for an order),
/// `sometimes_failing` (fails its first two calls at an amount of 7, recording what it handled
/// in `HANDLED`), `panicky` (panics on its first call at 13), and their call counts
/// (`flaky_calls`, `PANICKY_CALLS`).
#[macro_export]
macro_rules! payments_kit {
    ($db:ty, $conn:ty, $p1:literal) => {
        type Database = <$conn as sqlx::Connection>::Database;

        /// `n` orders, each with its payment event (and the event's id); those `picked`
        /// of `amount`, the others of 100.
        async fn orders_with_payments(
            db: &$db,
            n: usize,
            picked: impl Fn(usize) -> bool,
            amount: i64,
        ) -> Vec<(uuid::Uuid, $crate::fixtures::PaymentSucceeded)> {
            let mut payments = Vec::new();
            for i in 0..n {
                let order_id = uuid::Uuid::now_v7();
                sqlx::query(concat!("INSERT INTO orders (id) VALUES (", $p1, ")"))
                    .bind(order_id)
                    .execute(&db.pool)
                    .await
                    .unwrap();
                let event = $crate::fixtures::PaymentSucceeded {
                    payment_id: uuid::Uuid::now_v7(),
                    order_id,
                    amount: if picked(i) { amount } else { 100 },
                };
                payments.push((uuid::Uuid::now_v7(), event));
            }
            payments
        }

        /// `n` orders with a payment of 100 each.
        async fn plain_payments(
            db: &$db,
            n: usize,
        ) -> Vec<(uuid::Uuid, $crate::fixtures::PaymentSucceeded)> {
            orders_with_payments(db, n, |_| false, 0).await
        }

        /// `paid` of every order, in the order of `payments`.
        async fn paid(
            db: &$db,
            payments: &[(uuid::Uuid, $crate::fixtures::PaymentSucceeded)],
        ) -> Vec<i32> {
            let mut counts = Vec::new();
            for (_, p) in payments {
                let select = concat!("SELECT paid FROM orders WHERE id = ", $p1);
                let paid: i32 = sqlx::query_scalar(select)
                    .bind(p.order_id)
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
                counts.push(paid);
            }
            counts
        }

        /// The dedup rows of `handler`.
        async fn marked(db: &$db, handler: &str) -> i64 {
            sqlx::query_scalar(concat!(
                "SELECT COUNT(*) FROM processed_event WHERE handler = ",
                $p1
            ))
            .bind(handler)
            .fetch_one(&db.pool)
            .await
            .unwrap()
        }

        /// Marks the order paid. A negative amount is a permanent failure.
        #[outbox_runtime::inbox_handler]
        async fn mark_paid(
            event: $crate::fixtures::PaymentSucceeded,
            tx: &mut $conn,
        ) -> Result<(), outbox_runtime::inbox::HandlerError> {
            if event.amount < 0 {
                return Err(outbox_runtime::inbox::HandlerError::permanent(format!(
                    "negative amount {}",
                    event.amount
                )));
            }
            sqlx::query(concat!(
                "UPDATE orders SET paid = paid + 1 WHERE id = ",
                $p1
            ))
            .bind(event.order_id)
            .execute(tx)
            .await?;
            Ok(())
        }

        #[outbox_runtime::inbox_handler]
        async fn mark_refunded(
            event: $crate::fixtures::PaymentRefunded,
            tx: &mut $conn,
        ) -> Result<(), outbox_runtime::inbox::HandlerError> {
            sqlx::query(concat!(
                "UPDATE orders SET refunded = refunded + 1 WHERE id = ",
                $p1
            ))
            .bind(event.order_id)
            .execute(tx)
            .await?;
            Ok(())
        }

        /// Pays after a couple of milliseconds of work (so that a batch lasts long enough to
        /// be stopped in), counting the calls: the handler of `stopping`'s drill.
        #[outbox_runtime::inbox_handler]
        async fn mark_paid_counted(
            event: $crate::fixtures::PaymentSucceeded,
            tx: &mut $conn,
            counted: &$crate::stopping::Counted,
        ) -> Result<(), outbox_runtime::inbox::HandlerError> {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            sqlx::query(concat!(
                "UPDATE orders SET paid = paid + 1 WHERE id = ",
                $p1
            ))
            .bind(event.order_id)
            .execute(tx)
            .await?;
            counted.add();
            Ok(())
        }

        /// Calls of [`flaky`] (and of [`sometimes_failing`]'s failing orders), by order.
        static FLAKY_CALLS: std::sync::Mutex<std::collections::BTreeMap<uuid::Uuid, u32>> =
            std::sync::Mutex::new(std::collections::BTreeMap::new());

        fn flaky_calls(order: uuid::Uuid) -> u32 {
            FLAKY_CALLS
                .lock()
                .unwrap()
                .get(&order)
                .copied()
                .unwrap_or(0)
        }

        fn call(order: uuid::Uuid) -> u32 {
            let mut calls = FLAKY_CALLS.lock().unwrap();
            let n = calls.entry(order).or_default();
            *n += 1;
            *n
        }

        /// Pays, then fails (retryably) the first two times it sees an order: the failed
        /// attempts' writes must be undone, and only its own.
        #[outbox_runtime::inbox_handler]
        async fn flaky(
            event: $crate::fixtures::PaymentSucceeded,
            tx: &mut $conn,
        ) -> Result<(), outbox_runtime::inbox::HandlerError> {
            sqlx::query(concat!(
                "UPDATE orders SET paid = paid + 1 WHERE id = ",
                $p1
            ))
            .bind(event.order_id)
            .execute(&mut *tx)
            .await?;
            if call(event.order_id) <= 2 {
                return Err(outbox_runtime::inbox::HandlerError::retryable(
                    "the payment service is busy",
                ));
            }
            Ok(())
        }

        /// Orders [`sometimes_failing`] handled, in the order it handled them.
        static HANDLED: std::sync::Mutex<Vec<uuid::Uuid>> = std::sync::Mutex::new(Vec::new());

        /// Fails (retryably) on its first two calls for an order whose amount is 7, then
        /// pays it; pays the others at once. Records what it handled, in order.
        #[outbox_runtime::inbox_handler]
        async fn sometimes_failing(
            event: $crate::fixtures::PaymentSucceeded,
            tx: &mut $conn,
        ) -> Result<(), outbox_runtime::inbox::HandlerError> {
            if event.amount == 7 && call(event.order_id) <= 2 {
                return Err(outbox_runtime::inbox::HandlerError::retryable(
                    "the payment service is busy",
                ));
            }
            sqlx::query(concat!(
                "UPDATE orders SET paid = paid + 1 WHERE id = ",
                $p1
            ))
            .bind(event.order_id)
            .execute(&mut *tx)
            .await?;
            HANDLED.lock().unwrap().push(event.order_id);
            Ok(())
        }

        /// Calls of [`panicky`], by order.
        static PANICKY_CALLS: std::sync::Mutex<std::collections::BTreeMap<uuid::Uuid, u32>> =
            std::sync::Mutex::new(std::collections::BTreeMap::new());

        /// Pays, then panics on its first call for an order whose amount is 13.
        #[outbox_runtime::inbox_handler]
        async fn panicky(
            event: $crate::fixtures::PaymentSucceeded,
            tx: &mut $conn,
        ) -> Result<(), outbox_runtime::inbox::HandlerError> {
            let calls = {
                let mut calls = PANICKY_CALLS.lock().unwrap();
                let n = calls.entry(event.order_id).or_default();
                *n += 1;
                *n
            };
            sqlx::query(concat!(
                "UPDATE orders SET paid = paid + 1 WHERE id = ",
                $p1
            ))
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
    };
}
