//! The consumer's contract in dedup mode on NATS JetStream, one suite run on each database a
//! consumer commits to (PostgreSQL; MariaDB, the machine's 10.11), each test with its own
//! nats-server: a consumer waits for its stream; every event delivered twice takes effect
//! once; a failing message is delivered again after its backoff without holding the others;
//! retries in place keep the order the messages came in; failures are dead-lettered with
//! their reason and terminated; a panicking handler is retried; a stopped consumer finishes
//! the batch in hand and no more; what is read ahead during a long batch is not delivered
//! again; messages delivered again twice are handled in the stream's order. The lease
//! (several instances, crashes, handovers) is `jetstream_lease.rs`'s suite; what is run on
//! PostgreSQL only (inbox mode, the server killed, the broker-loss drill) is in
//! `consumer_jetstream.rs`.

/// The payments stream, and its dead letters'.
const STREAM: &str = "PAYMENTS";
const DEAD_LETTERS: &str = "PAYMENTS_DLQ";

/// Sleeps `pause` with `flag` set meanwhile (a test waits for it).
async fn pause_flagged(flag: &std::sync::atomic::AtomicBool, pause: std::time::Duration) {
    flag.store(true, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(pause).await;
    flag.store(false, std::sync::atomic::Ordering::SeqCst);
}

/// Waits until group `group` has settled every message of `stream` (acknowledged or
/// terminated, none waiting).
async fn wait_settled(
    server: &outbox_tests::nats::NatsServer,
    stream: &str,
    group: &str,
    topic: &str,
) {
    let durable = format!("{group}_{}", topic.replace('.', "_"));
    outbox_tests::payments::wait_for(
        "every message settled",
        std::time::Duration::from_secs(60),
        || async { server.unsettled(stream, &durable).await == Some((0, 0)) },
    )
    .await;
}

/// The suite, for one database: `$db` its test database type (`new()`, a `pool` field),
/// `$orders` what creates its `orders` table, `$steps` the module with its `create_steps`,
/// `record_step` and `steps`, `$conn` its connection type, `$p1` how its SQL spells the first
/// bound parameter and `$p2` the second, `$count` its counting query, `$handled` the DDL of a table `handled`
/// (`n`, numbered as rows come; `order_id`; `attempt`).
macro_rules! jetstream_suite {
    ($name:ident, $db:ty, $orders:path, $steps:path, $conn:ty, $p1:literal, $p2:literal,
     $count:path, $handled:literal) => {
        mod $name {
            use std::sync::atomic::{AtomicBool, Ordering};
            use std::time::Duration;

            use outbox_runtime::inbox::{
                BoxFuture, Consumer, ConsumerBuilder, Handler, HandlerError, MessageMeta,
                RetryPolicy,
            };
            use outbox_runtime::relay::JetStream;
            use outbox_tests::deposits::{interleaved, TOPIC};
            use outbox_tests::fixtures::{PaymentSucceeded, PAYMENTS};
            use outbox_tests::kafka::Outgoing;
            use outbox_tests::nats::NatsServer;
            use outbox_tests::payments::{not_json, records, wait_for};
            use outbox_tests::Running;
            use uuid::Uuid;
            use $steps as steps_db;

            use outbox_tests::nats::assert_dead_letter;

            use super::{pause_flagged, wait_settled, DEAD_LETTERS, STREAM};

            outbox_tests::payments_kit!($db, $conn, $p1);

            /// A test's database with the orders table, and its own server with the payments
            /// streams.
            async fn setup() -> ($db, NatsServer) {
                let db = <$db>::new().await;
                $orders(&db.pool).await;
                let server = NatsServer::start().await;
                server.create_stream(STREAM, PAYMENTS, |_| {}).await;
                let dlq = format!("{PAYMENTS}.dlq");
                server.create_stream(DEAD_LETTERS, &dlq, |_| {}).await;
                (db, server)
            }

            /// A consumer of group `group` reading `server`'s JetStream, quick to retry.
            async fn builder(
                db: &$db,
                server: &NatsServer,
                group: &str,
            ) -> ConsumerBuilder<(), Database> {
                Consumer::builder(db.pool.clone())
                    .jetstream(
                        JetStream::new(server.client().await).ack_wait(Duration::from_secs(2)),
                    )
                    .group_id(group)
                    .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn every_event_delivered_twice_takes_effect_once() {
                let (db, server) = setup().await;
                let payments = plain_payments(&db, 100).await;
                let records = records(&payments);
                // Everything once, then everything again in the opposite order.
                let mut twice = records.clone();
                twice.extend(records.iter().rev().cloned());
                server.publish(PAYMENTS, &twice).await;
                let consumer = builder(&db, &server, "orders")
                    .await
                    .handler(mark_paid)
                    .build()
                    .unwrap();
                drain(&server, &consumer).await;
                assert_eq!(paid(&db, &payments).await, vec![1; 100]);
                assert_eq!(marked(&db, "orders/mark_paid").await, 100);
                assert_eq!(
                    $count(&db.pool, "SELECT COUNT(*) FROM processed_event").await,
                    100
                );
                assert!(server.read_stream(DEAD_LETTERS).await.is_empty());
            }

            /// Runs `consumer` (of group `orders`) until every payment is settled, then stops
            /// it.
            async fn drain(server: &NatsServer, consumer: &Consumer) {
                let running = Running::consumer(consumer);
                wait_settled(server, STREAM, "orders", PAYMENTS).await;
                running.stop().await;
            }

            /// A consumer started before its stream exists waits for it (and says so), and
            /// handles what comes once it does; nothing fails.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_consumer_waits_for_its_stream() {
                let db = <$db>::new().await;
                $orders(&db.pool).await;
                let server = NatsServer::start().await;
                let consumer = builder(&db, &server, "orders")
                    .await
                    .handler(mark_paid)
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                let payments = plain_payments(&db, 10).await;
                server.create_stream(STREAM, PAYMENTS, |_| {}).await;
                server.publish(PAYMENTS, &records(&payments)).await;
                wait_settled(&server, STREAM, "orders", PAYMENTS).await;
                assert!(!running.is_finished());
                running.stop().await;
                assert_eq!(paid(&db, &payments).await, vec![1; 10]);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_failing_message_is_redelivered_after_its_backoff_without_holding_the_others()
            {
                let (db, server) = setup().await;
                // Every tenth fails twice, then succeeds.
                let payments = orders_with_payments(&db, 30, |i| i % 10 == 0, 7).await;
                server.publish(PAYMENTS, &records(&payments)).await;
                let consumer = builder(&db, &server, "orders")
                    .await
                    .handler(sometimes_failing)
                    .build()
                    .unwrap();
                drain(&server, &consumer).await;
                assert_eq!(paid(&db, &payments).await, vec![1; 30]);
                for (i, (_, payment)) in payments.iter().enumerate() {
                    let calls = flaky_calls(payment.order_id);
                    assert_eq!(calls, if i % 10 == 0 { 3 } else { 0 }, "payment {i}");
                }
                // Each failing payment was handled after the one published right after it:
                // redelivered later, it held nothing up.
                let handled = HANDLED.lock().unwrap().clone();
                let at = |order| handled.iter().position(|o| *o == order).unwrap();
                for i in [0, 10, 20] {
                    assert!(
                        at(payments[i].1.order_id) > at(payments[i + 1].1.order_id),
                        "payment {i} was handled before the next one"
                    );
                }
                assert!(server.read_stream(DEAD_LETTERS).await.is_empty());
            }

            /// Pays and records the payment in `handled` (what commits, in the order it
            /// commits); fails its first two attempts at a payment of 7.
            #[outbox_runtime::inbox_handler]
            async fn pay_failing_twice_on_seven(
                event: PaymentSucceeded,
                tx: &mut $conn,
                meta: &MessageMeta<'_>,
            ) -> Result<(), HandlerError> {
                if event.amount == 7 && meta.attempt() <= 2 {
                    return Err(HandlerError::retryable("the payment service is busy"));
                }
                sqlx::query(concat!(
                    "UPDATE orders SET paid = paid + 1 WHERE id = ",
                    $p1
                ))
                .bind(event.order_id)
                .execute(&mut *tx)
                .await?;
                sqlx::query(concat!(
                    "INSERT INTO handled (order_id, attempt) VALUES (",
                    $p1,
                    ", ",
                    $p2,
                    ")"
                ))
                .bind(event.order_id)
                .bind(meta.attempt() as i32)
                .execute(&mut *tx)
                .await?;
                Ok(())
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn in_place_retries_keep_the_order_they_came_in() {
                let (db, server) = setup().await;
                sqlx::query($handled).execute(&db.pool).await.unwrap();
                // Every tenth from the fifth fails twice, then succeeds.
                let payments = orders_with_payments(&db, 30, |i| i % 10 == 4, 7).await;
                server.publish(PAYMENTS, &records(&payments)).await;
                let consumer = builder(&db, &server, "orders")
                    .await
                    .handler(pay_failing_twice_on_seven)
                    .retry_policy(RetryPolicy::InPlace)
                    .build()
                    .unwrap();
                drain(&server, &consumer).await;
                assert_eq!(paid(&db, &payments).await, vec![1; 30]);
                let handled: Vec<(Uuid, i32)> =
                    sqlx::query_as("SELECT order_id, attempt FROM handled ORDER BY n")
                        .fetch_all(&db.pool)
                        .await
                        .unwrap();
                let expected: Vec<(Uuid, i32)> = payments
                    .iter()
                    .enumerate()
                    .map(|(i, (_, p))| (p.order_id, if i % 10 == 4 { 3 } else { 1 }))
                    .collect();
                assert_eq!(
                    handled, expected,
                    "in the order published, on the third attempt at 7s"
                );
                assert!(server.read_stream(DEAD_LETTERS).await.is_empty());
            }

            /// A handler that fails retryably on one order (and records nothing).
            struct FailsOn(Uuid);

            impl Handler<(), Database> for FailsOn {
                type Event = PaymentSucceeded;

                fn name(&self) -> &str {
                    "fails_on"
                }

                fn handle<'a>(
                    &'a self,
                    event: PaymentSucceeded,
                    _tx: &'a mut $conn,
                    _state: &'a (),
                    _meta: &'a MessageMeta<'a>,
                ) -> BoxFuture<'a, Result<(), HandlerError>> {
                    Box::pin(async move {
                        if event.order_id == self.0 {
                            return Err(HandlerError::retryable("the ledger is closed"));
                        }
                        Ok(())
                    })
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn failures_are_dead_lettered_with_their_reason_and_terminated() {
                let (db, server) = setup().await;
                let payments = plain_payments(&db, 6).await;
                let mut records = records(&payments);
                // Permanent: a negative amount.
                let negative = PaymentSucceeded {
                    amount: -5,
                    ..payments[0].1.clone()
                };
                records[0] = Outgoing::event(&negative, payments[0].0);
                // Bad input: not JSON; a schema version no handler takes.
                records.push(not_json());
                records[1]
                    .headers
                    .push(("outbox_schema_version".into(), "9".into()));
                server.publish(PAYMENTS, &records).await;
                // A handler that always fails retryably on order 2: dead after max_attempts.
                let always_failing = payments[2].1.order_id;
                let consumer = builder(&db, &server, "orders")
                    .await
                    .handler(mark_paid)
                    .handler(FailsOn(always_failing))
                    .max_attempts(3)
                    .build()
                    .unwrap();
                drain(&server, &consumer).await;

                let letters = server.read_stream(DEAD_LETTERS).await;
                assert_eq!(letters.len(), 4, "{letters:?}");
                let of = |event_id: &Uuid| {
                    letters
                        .iter()
                        .find(|l| l.headers.get("event_id") == Some(&event_id.to_string()))
                        .unwrap_or_else(|| panic!("no dead letter of {event_id}"))
                };
                assert_dead_letter(of(&payments[0].0), STREAM, "negative amount -5", "1");
                assert_dead_letter(of(&payments[1].0), STREAM, "schema version 9", "1");
                assert_dead_letter(of(&payments[2].0), STREAM, "the ledger is closed", "3");
                let not_json = letters
                    .iter()
                    .find(|l| !l.headers.contains_key("event_id"))
                    .unwrap();
                assert_dead_letter(not_json, STREAM, "payload is not JSON", "1");
                // Each keeps its payload and headers.
                assert_eq!(of(&payments[2].0).header("event_type"), "PaymentSucceeded");
                assert_eq!(
                    of(&payments[2].0).payload["order_id"],
                    serde_json::json!(always_failing)
                );
                // Orders 2 to 5 paid once (order 2's payment too: its other handler's work
                // committed on the first attempt and was deduplicated on the next), orders 0
                // and 1 never.
                assert_eq!(paid(&db, &payments).await, [0, 0, 1, 1, 1, 1]);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_panicking_handler_is_retried_and_the_consumer_goes_on() {
                let (db, server) = setup().await;
                let payments = orders_with_payments(&db, 20, |i| i == 3, 13).await;
                server.publish(PAYMENTS, &records(&payments)).await;
                let consumer = builder(&db, &server, "orders")
                    .await
                    .handler(panicky)
                    .build()
                    .unwrap();
                drain(&server, &consumer).await;
                assert_eq!(paid(&db, &payments).await, vec![1; 20]);
                assert!(PANICKY_CALLS.lock().unwrap()[&payments[3].1.order_id] >= 2);
                assert!(server.read_stream(DEAD_LETTERS).await.is_empty());
            }

            /// Set while [`pay_slowly`] pauses.
            static PAUSING: AtomicBool = AtomicBool::new(false);

            /// Pays, a few milliseconds after it is called (a handler with work to do); over a
            /// payment of 4,242 it first pauses 5 s (two and a half times the tests'
            /// `ack_wait` of 2 s).
            #[outbox_runtime::inbox_handler]
            async fn pay_slowly(
                event: PaymentSucceeded,
                tx: &mut $conn,
            ) -> Result<(), HandlerError> {
                if event.amount == 4_242 {
                    pause_flagged(&PAUSING, Duration::from_secs(5)).await;
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
                sqlx::query(concat!(
                    "UPDATE orders SET paid = paid + 1 WHERE id = ",
                    $p1
                ))
                .bind(event.order_id)
                .execute(tx)
                .await?;
                Ok(())
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stopped_consumer_finishes_the_batch_in_hand_and_no_more_of_its_backlog() {
                // While a batch is handled the next one is read; a consumer told to stop must
                // still stop after the batch in hand, not go on while there is a backlog.
                let (db, server) = setup().await;
                let payments = plain_payments(&db, 3_000).await;
                server.publish(PAYMENTS, &records(&payments)).await;
                let consumer = builder(&db, &server, "orders")
                    .await
                    .handler(pay_slowly)
                    .batch_size(50)
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                let paid_any = || $count(&db.pool, "SELECT COUNT(*) FROM orders WHERE paid > 0");
                wait_for("a few batches handled", Duration::from_secs(60), || async {
                    paid_any().await >= 100
                })
                .await;
                running.stop().await;
                let at_stop = paid_any().await;
                // The batch in hand when it was told to stop, and the one that may have begun
                // meanwhile.
                assert!(
                    at_stop < 300,
                    "{at_stop} of 3,000 events handled after the stop was asked for at 100 or more"
                );
                // What it had read ahead was not settled: a consumer of the group gets it,
                // once each.
                let consumer = builder(&db, &server, "orders")
                    .await
                    .handler(mark_paid)
                    .build()
                    .unwrap();
                drain(&server, &consumer).await;
                assert_eq!(paid(&db, &payments).await, vec![1; 3_000]);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn what_is_read_ahead_during_a_long_batch_is_not_delivered_again() {
                // Messages read while a batch is handled wait for it; the server must be told
                // they are being worked on, as the batch's own are, or it delivers them again
                // after `ack_wait`: copies that come back behind later messages of their key.
                let (db, server) = setup().await;
                let payments = orders_with_payments(&db, 36, |i| i == 0, 4_242).await;
                let records = records(&payments);
                let consumer = builder(&db, &server, "orders")
                    .await
                    .handler(pay_slowly)
                    .batch_size(10)
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                // The slow one alone is the first batch; the 35 others (three and a half
                // batches, within the four the server may have out at once) come while it is
                // handled.
                server.publish(PAYMENTS, &records[..1]).await;
                wait_for("the long batch begun", Duration::from_secs(30), || async {
                    PAUSING.load(Ordering::SeqCst)
                })
                .await;
                server.publish(PAYMENTS, &records[1..]).await;
                // While the pause lasts (past `ack_wait` for the 35), the server must not have
                // delivered any of them again (it counts the messages delivered again and not
                // yet settled).
                let js = server.jetstream().await;
                let durable = format!("orders_{}", PAYMENTS.replace('.', "_"));
                let mut redelivered = 0;
                while PAUSING.load(Ordering::SeqCst) {
                    let stream = js.get_stream(STREAM).await.unwrap();
                    let info = stream.consumer_info(&durable).await.unwrap();
                    redelivered = redelivered.max(info.num_redelivered);
                    tokio::time::sleep(Duration::from_millis(50)).await; // the pause's pace
                }
                wait_settled(&server, STREAM, "orders", PAYMENTS).await;
                running.stop().await;
                assert_eq!(paid(&db, &payments).await, vec![1; 36]);
                assert_eq!(
                    redelivered, 0,
                    "messages delivered again while they waited for the batch before them"
                );
            }

            /// JetStream delivers again what a consumer did not acknowledge in time in the
            /// order the waits ran out, so a message delivered again and left unacknowledged
            /// once more comes back behind the others. Sessions ending one after another (a
            /// consumer gone holding a key's events 0..6, then one holding event 0, then one
            /// holding event 1) leave the server delivering 2, 3, 4, 5, 0, 1. The consumer
            /// still handles the key's events in order, two at a time.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn messages_delivered_again_twice_are_handled_in_the_streams_order() {
                let db = <$db>::new().await;
                steps_db::create_steps(&db.pool).await;
                let server = NatsServer::start().await;
                server.create_stream("ACCOUNTS", TOPIC, |_| {}).await;
                let consumer = || async {
                    builder(&db, &server, "ledger")
                        .await
                        .handler(steps_db::record_step)
                        .batch_size(2)
                        .build()
                        .unwrap()
                };
                // The group's durable consumer, as the consumer creates it.
                let running = Running::consumer(&consumer().await);
                let durable = "ledger_account_events";
                wait_for("the durable consumer", Duration::from_secs(30), || async {
                    server.unsettled("ACCOUNTS", durable).await.is_some()
                })
                .await;
                running.stop().await;
                server.publish(TOPIC, &interleaved(1, 6)).await;
                let mut fetched = Vec::new();
                for n in [6, 1, 1] {
                    fetched.push(server.fetch_and_go_away("ACCOUNTS", durable, n).await);
                }
                assert_eq!(fetched, [vec![1, 2, 3, 4, 5, 6], vec![1], vec![2]]);
                let running = Running::consumer(&consumer().await);
                wait_settled(&server, "ACCOUNTS", "ledger", TOPIC).await;
                running.stop().await;
                assert_eq!($count(&db.pool, "SELECT COUNT(*) FROM steps").await, 6);
                assert_eq!(
                    steps_db::steps(&db.pool).await["acct-0"],
                    (0..6).collect::<Vec<i64>>()
                );
            }
        }
    };
}

jetstream_suite!(
    postgres,
    outbox_tests::TestDb,
    outbox_tests::fixtures::create_orders,
    outbox_tests::deposits,
    sqlx::PgConnection,
    "$1",
    "$2",
    outbox_tests::count,
    "CREATE TABLE handled (n bigserial PRIMARY KEY, order_id uuid NOT NULL, attempt int NOT NULL)"
);

jetstream_suite!(
    mariadb,
    outbox_tests::mysql::MySqlTestDb,
    outbox_tests::mysql::create_orders,
    outbox_tests::mysql,
    sqlx::MySqlConnection,
    "?",
    "?",
    outbox_tests::mysql::count,
    "CREATE TABLE handled (n BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BINARY(16) NOT NULL, \
     attempt INT NOT NULL)"
);
