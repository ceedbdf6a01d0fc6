//! The consumer's contract in dedup mode on RabbitMQ, one suite run on each database a
//! consumer commits to (PostgreSQL; MariaDB, the machine's 10.11), against the machine's node
//! (each test in a vhost of its own): each event's effect once over redelivered duplicates, in
//! each key's order; failures waiting in the delay queue, then succeeding or dead-lettered;
//! poison messages and panics dead-lettered, not redelivered forever; a stopped consumer
//! taking no batch after the one in hand; a consumer gone after its commit, before its
//! acknowledgement, applying each once when its messages come again; two instances sharing
//! the shards, one active on each, handing over in each key's order. What is run on
//! PostgreSQL only so far (inbox mode, shard queues read two batches at a time, missing
//! queues, names over AMQP's limit) is in `consumer_rabbitmq.rs`; a message returned twice is
//! in `consumer_rabbitmq.rs` (both modes) and `consumer_mysql.rs` (MariaDB).

/// Shards of every topic here.
const SHARDS: u16 = 4;

/// The suite, for one database: `$db` its test database type (`new()`, a `pool` field),
/// `$orders` what creates its `orders` table, `$steps` the module with its `create_steps`,
/// `record_step` and `steps`, `$conn` its connection type, `$p1` how its SQL spells the first
/// bound parameter, `$count` its counting query.
macro_rules! rabbitmq_suite {
    ($name:ident, $db:ty, $orders:path, $steps:path, $conn:ty, $p1:literal, $count:path) => {
        mod $name {
            use std::collections::BTreeMap;
            use std::sync::Mutex;
            use std::time::Duration;

            use outbox_runtime::inbox::{Consumer, ConsumerBuilder, HandlerError, MessageMeta};
            use outbox_runtime::relay::RabbitMq;
            use outbox_tests::deposits::{interleaved, TOPIC};
            use outbox_tests::fixtures::{PaymentSucceeded, PAYMENTS};
            use outbox_tests::payments::{not_json, records, wait_for};
            use outbox_tests::rabbitmq::{self as mq, dead_letters, Vhost};
            use outbox_tests::stopping;
            use outbox_tests::Running;
            use uuid::Uuid;
            use $steps as steps_db;

            use super::SHARDS;

            outbox_tests::payments_kit!($db, $conn, $p1);

            fn rabbit(url: &str) -> RabbitMq {
                RabbitMq::new(url)
                    .shards(SHARDS)
                    .heartbeat(Duration::from_secs(2))
            }

            /// A consumer of group `group` reading `url`, quick to retry.
            fn builder(db: &$db, url: &str, group: &str) -> ConsumerBuilder<(), Database> {
                Consumer::builder(db.pool.clone())
                    .rabbitmq(rabbit(url))
                    .group_id(group)
                    .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
            }

            /// A test's vhost with the payments' topology, and its database with the orders
            /// table.
            async fn setup(vhost: &str) -> (Vhost, $db) {
                let vhost = Vhost::new(vhost);
                let db = <$db>::new().await;
                $orders(&db.pool).await;
                rabbit(&vhost.url())
                    .ensure_topology(PAYMENTS, "orders")
                    .await
                    .unwrap();
                (vhost, db)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn each_event_takes_effect_once_in_each_keys_order() {
                let vhost = Vhost::new("rc-dedup");
                let url = vhost.url();
                let db = <$db>::new().await;
                steps_db::create_steps(&db.pool).await;
                rabbit(&url).ensure_topology(TOPIC, "ledger").await.unwrap();
                // 8 accounts' events interleaved, then every one again (the relay sending it
                // twice: same event id), behind them.
                let records = interleaved(8, 20);
                mq::publish_sharded(&url, TOPIC, SHARDS, &records).await;
                mq::publish_sharded(&url, TOPIC, SHARDS, &records).await;
                let consumer = builder(&db, &url, "ledger")
                    .handler(steps_db::record_step)
                    .batch_size(25)
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                wait_for("all 320 settled", Duration::from_secs(60), || async {
                    $count(&db.pool, "SELECT COUNT(*) FROM steps").await >= 160
                        && mq::settled(&vhost, TOPIC, "ledger", SHARDS)
                })
                .await;
                running.stop().await;
                let steps = steps_db::steps(&db.pool).await;
                assert_eq!(steps.len(), 8);
                for (account, seqs) in steps {
                    assert_eq!(seqs, (0..20).collect::<Vec<i64>>(), "account {account}");
                }
                assert_eq!(
                    $count(&db.pool, "SELECT COUNT(*) FROM processed_event").await,
                    160
                );
                assert_eq!(
                    mq::queue_depth(&url, &format!("{TOPIC}.dlq")).await,
                    Some(0)
                );
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stopped_consumer_finishes_the_batch_in_hand_and_no_more_of_its_backlog() {
                // One shard queue: one reader, whose batch in hand is the bound.
                let vhost = Vhost::new("rc-stop");
                let url = vhost.url();
                let db = <$db>::new().await;
                $orders(&db.pool).await;
                let one_shard = rabbit(&url).shards(1);
                one_shard.ensure_topology(PAYMENTS, "orders").await.unwrap();
                let payments = plain_payments(&db, 2_000).await;
                mq::publish_sharded(&url, PAYMENTS, 1, &records(&payments)).await;
                let start = |counted| {
                    Consumer::builder(db.pool.clone())
                        .rabbitmq(one_shard.clone())
                        .group_id("orders")
                        .state(counted)
                        .handler(mark_paid_counted)
                        .batch_size(stopping::BATCH)
                        .build()
                        .unwrap()
                };
                stopping::stops_after_the_batch_in_hand(2_000, start, |sql| $count(&db.pool, sql))
                    .await;
            }

            /// Closed until the test opens it: [`pay_when_open`] waits for it.
            static GO: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);

            /// Pays, once the test let it.
            #[outbox_runtime::inbox_handler]
            async fn pay_when_open(
                event: PaymentSucceeded,
                tx: &mut $conn,
            ) -> Result<(), HandlerError> {
                drop(GO.acquire().await.map_err(HandlerError::permanent)?);
                sqlx::query(concat!(
                    "UPDATE orders SET paid = paid + 1 WHERE id = ",
                    $p1
                ))
                .bind(event.order_id)
                .execute(&mut *tx)
                .await?;
                Ok(())
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_consumer_gone_after_its_commit_before_its_ack_is_redelivered_with_one_effect(
            ) {
                let (vhost, db) = setup("rc-ack").await;
                let url = vhost.url();
                let rabbit = |url: &str| rabbit(url).heartbeat(Duration::from_secs(1));
                let payments = plain_payments(&db, 20).await;
                mq::publish_sharded(&url, PAYMENTS, SHARDS, &records(&payments)).await;
                // The first instance talks to the node through a proxy, which goes dark once
                // it holds its first message of each shard (a session starts with a prefetch
                // of one) and before any is handled: no acknowledgement of what it commits
                // reaches the node.
                let proxy = mq::TcpProxy::start("127.0.0.1:5672").await;
                let first = Consumer::builder(db.pool.clone())
                    .rabbitmq(rabbit(&proxy.url(&vhost.name)))
                    .group_id("orders")
                    .handler(pay_when_open)
                    .batch_size(50)
                    .build()
                    .unwrap();
                let running = Running::consumer(&first);
                let busy: std::collections::BTreeSet<u16> = payments
                    .iter()
                    .map(|(_, p)| mq::shard_of(&p.payment_id.to_string(), SHARDS))
                    .collect();
                let busy = busy.len() as u64;
                let totals = || mq::shard_totals(None, &vhost.name, PAYMENTS, "orders");
                wait_for(
                    "one message of each shard in hand",
                    Duration::from_secs(30),
                    || async { totals() == (20, busy, SHARDS.into()) },
                )
                .await;
                proxy.black_hole();
                GO.add_permits(1);
                let paid_any = || $count(&db.pool, "SELECT COUNT(*) FROM orders WHERE paid > 0");
                wait_for("those committed", Duration::from_secs(30), || async {
                    paid_any().await == busy as i64
                })
                .await;
                running.abort();
                // The node gives the silent connection up (missed heartbeats): all 20 are in
                // their queues again, those committed too, for none was acknowledged.
                wait_for(
                    "the 20 back in their queues, no consumer",
                    Duration::from_secs(30),
                    || async { totals() == (20, 0, 0) },
                )
                .await;
                let second = Consumer::builder(db.pool.clone())
                    .rabbitmq(rabbit(&url))
                    .group_id("orders")
                    .handler(pay_when_open)
                    .build()
                    .unwrap();
                let running = Running::consumer(&second);
                wait_for(
                    "the redelivered 20 settled",
                    Duration::from_secs(30),
                    || async { totals() == (0, 0, SHARDS.into()) },
                )
                .await;
                running.stop().await;
                assert_eq!(
                    paid(&db, &payments).await,
                    vec![1; 20],
                    "effects still once"
                );
                assert_eq!(
                    $count(&db.pool, "SELECT COUNT(*) FROM processed_event").await,
                    20
                );
            }

            /// Two instances of a group: each shard queue has a consumer of each, one active;
            /// when the first stops, the second takes every shard over, and each key's events
            /// are handled once, in order, across the handover.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn two_instances_share_the_shards_one_active_each_and_hand_over() {
                let vhost = Vhost::new("rc-two");
                let url = vhost.url();
                let db = <$db>::new().await;
                steps_db::create_steps(&db.pool).await;
                let start = || {
                    let consumer = builder(&db, &url, "ledger")
                        .handler(steps_db::record_step)
                        .batch_size(25)
                        .build()
                        .unwrap();
                    Running::consumer(&consumer)
                };
                let first = start();
                let second = start();
                let consumers = |all, active| {
                    mq::shard_consumers(&vhost, TOPIC, "ledger", SHARDS)
                        .values()
                        .all(|c| *c == (all, active))
                };
                wait_for(
                    "each shard queue: two consumers, one active",
                    Duration::from_secs(30),
                    || async { consumers(2, 1) },
                )
                .await;
                // 10 accounts, 30 events each: the first 15 of each while both run.
                let records = interleaved(10, 30);
                let (early, late) = records.split_at(150);
                mq::publish_sharded(&url, TOPIC, SHARDS, early).await;
                let steps = || $count(&db.pool, "SELECT COUNT(*) FROM steps");
                wait_for("the first 150 handled", Duration::from_secs(60), || async {
                    steps().await == 150
                })
                .await;
                first.stop().await;
                wait_for(
                    "the second instance active on every shard",
                    Duration::from_secs(30),
                    || async { consumers(1, 1) },
                )
                .await;
                mq::publish_sharded(&url, TOPIC, SHARDS, late).await;
                wait_for("all 300 settled", Duration::from_secs(60), || async {
                    steps().await >= 300 && mq::settled(&vhost, TOPIC, "ledger", SHARDS)
                })
                .await;
                second.stop().await;
                let steps = steps_db::steps(&db.pool).await;
                assert_eq!(steps.len(), 10);
                for (account, seqs) in steps {
                    assert_eq!(seqs, (0..30).collect::<Vec<i64>>(), "account {account}");
                }
            }

            /// Attempts seen by [`pay_failing`], by order, in the order they were made.
            static ATTEMPTS: Mutex<BTreeMap<Uuid, Vec<u32>>> = Mutex::new(BTreeMap::new());
            /// Orders [`pay_failing`] paid, in the order it paid them.
            static PAID: Mutex<Vec<Uuid>> = Mutex::new(Vec::new());

            /// Records the attempt; an amount of 7 fails its first two attempts, 99 every one,
            /// 13 panics every time; pays the rest.
            #[outbox_runtime::inbox_handler]
            async fn pay_failing(
                event: PaymentSucceeded,
                tx: &mut $conn,
                meta: &MessageMeta<'_>,
            ) -> Result<(), HandlerError> {
                ATTEMPTS
                    .lock()
                    .unwrap()
                    .entry(event.order_id)
                    .or_default()
                    .push(meta.attempt());
                match event.amount {
                    7 if meta.attempt() <= 2 => {
                        return Err(HandlerError::retryable("the payment service is busy"))
                    }
                    99 => return Err(HandlerError::retryable("the ledger is closed")),
                    13 => panic!("the payment provider's client panicked"),
                    _ => {}
                }
                sqlx::query(concat!(
                    "UPDATE orders SET paid = paid + 1 WHERE id = ",
                    $p1
                ))
                .bind(event.order_id)
                .execute(&mut *tx)
                .await?;
                PAID.lock().unwrap().push(event.order_id);
                Ok(())
            }

            /// The attempts at `order`'s payment (a handler runs again, at the same attempt,
            /// when its batch's transaction is given up for another message's failure).
            fn attempts(order: Uuid) -> Vec<u32> {
                let mut seen = ATTEMPTS
                    .lock()
                    .unwrap()
                    .get(&order)
                    .cloned()
                    .unwrap_or_default();
                seen.dedup();
                seen
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn failures_wait_in_the_delay_queue_then_succeed_or_are_dead_lettered() {
                let (vhost, db) = setup("rc-retry").await;
                let url = vhost.url();
                let payments = orders_with_payments(&db, 30, |i| [0, 10, 20].contains(&i), 7).await;
                let mut payments = payments;
                payments[5].1.amount = 99;
                mq::publish_sharded(&url, PAYMENTS, SHARDS, &records(&payments)).await;
                let consumer = builder(&db, &url, "orders")
                    .handler(pay_failing)
                    .max_attempts(3)
                    .retry_backoff(Duration::from_millis(1500), Duration::from_millis(1500))
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                let delay_queues: Vec<String> = (0..SHARDS)
                    .map(|s| format!("{PAYMENTS}.orders.{s}.retry"))
                    .collect();
                wait_for(
                    "a retry in a delay queue",
                    Duration::from_secs(30),
                    || async {
                        let mut waiting = 0;
                        for q in &delay_queues {
                            waiting += mq::queue_depth(&url, q).await.unwrap_or(0);
                        }
                        waiting >= 1
                    },
                )
                .await;
                wait_for("all settled", Duration::from_secs(60), || async {
                    $count(&db.pool, "SELECT COUNT(*) FROM orders WHERE paid > 0").await == 29
                        && mq::settled(&vhost, PAYMENTS, "orders", SHARDS)
                })
                .await;
                running.stop().await;
                let paid_in_order = PAID.lock().unwrap().clone();
                let at = |order| paid_in_order.iter().position(|o| *o == order).unwrap();
                for (i, (_, payment)) in payments.iter().enumerate() {
                    let order = payment.order_id;
                    match i {
                        // The attempt header grew through the delay queue; it held up nothing
                        // of its shard (every later payment of the shard paid before it).
                        0 | 10 | 20 => {
                            assert_eq!(attempts(order), vec![1, 2, 3], "payment {i}");
                            let shard = mq::shard_of(&payment.payment_id.to_string(), SHARDS);
                            for (_, later) in payments[i + 1..]
                                .iter()
                                .filter(|(_, p)| p.amount == 100)
                                .filter(|(_, p)| {
                                    mq::shard_of(&p.payment_id.to_string(), SHARDS) == shard
                                })
                            {
                                assert!(
                                    at(later.order_id) < at(order),
                                    "payment {i} held its shard up"
                                );
                            }
                        }
                        5 => assert_eq!(attempts(order), vec![1, 2, 3], "dead after 3"),
                        _ => assert_eq!(attempts(order), vec![1], "payment {i}"),
                    }
                }
                let mut expected = vec![1; 30];
                expected[5] = 0;
                assert_eq!(paid(&db, &payments).await, expected);
                let letters = dead_letters(&url, PAYMENTS, 1).await;
                mq::assert_dead_letter(&letters[0], "the ledger is closed", "3", SHARDS);
                assert_eq!(letters[0].header("event_id"), payments[5].0.to_string());
                assert_eq!(
                    letters[0].payload["order_id"],
                    serde_json::json!(payments[5].1.order_id)
                );
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn poison_messages_and_panics_are_dead_lettered_not_redelivered_forever() {
                let (vhost, db) = setup("rc-poison").await;
                let url = vhost.url();
                // The fifth panics every time.
                let payments = orders_with_payments(&db, 10, |i| i == 4, 13).await;
                let mut records = records(&payments);
                // No event id, not JSON; an event id and a body cut short.
                records.insert(3, not_json());
                let mut cut = records[0].clone();
                cut.headers[0].1 = Uuid::now_v7().to_string();
                cut.payload.truncate(5);
                records.push(cut);
                mq::publish_sharded(&url, PAYMENTS, SHARDS, &records).await;
                let consumer = builder(&db, &url, "orders")
                    .handler(pay_failing)
                    .max_attempts(3)
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                wait_for("all settled", Duration::from_secs(60), || async {
                    $count(&db.pool, "SELECT COUNT(*) FROM orders WHERE paid > 0").await == 9
                        && mq::settled(&vhost, PAYMENTS, "orders", SHARDS)
                })
                .await;
                // Settled stays settled: nothing comes back.
                let panicking = payments[4].1.order_id;
                assert_eq!(attempts(panicking), vec![1, 2, 3]);
                assert!(!running.is_finished(), "a panic does not stop the consumer");
                running.stop().await;
                assert!(mq::settled(&vhost, PAYMENTS, "orders", SHARDS));
                assert_eq!(attempts(panicking), vec![1, 2, 3]);
                let letters = dead_letters(&url, PAYMENTS, 3).await;
                let with_reason = |reason: &str| {
                    letters
                        .iter()
                        .find(|l| l.header("dlq_error").contains(reason))
                        .unwrap_or_else(|| panic!("no dead letter says {reason}: {letters:?}"))
                };
                let no_id = letters
                    .iter()
                    .find(|l| !l.headers.contains_key("event_id"))
                    .expect("the message without an event id");
                mq::assert_dead_letter(no_id, "payload is not JSON", "1", SHARDS);
                let eof = with_reason("EOF");
                mq::assert_dead_letter(eof, "payload is not JSON", "1", SHARDS);
                let panicked = with_reason("panic");
                mq::assert_dead_letter(panicked, "panic", "3", SHARDS);
                assert_eq!(panicked.header("event_id"), payments[4].0.to_string());
            }
        }
    };
}

rabbitmq_suite!(
    postgres,
    outbox_tests::TestDb,
    outbox_tests::fixtures::create_orders,
    outbox_tests::deposits,
    sqlx::PgConnection,
    "$1",
    outbox_tests::count
);

rabbitmq_suite!(
    mariadb,
    outbox_tests::mysql::MySqlTestDb,
    outbox_tests::mysql::create_orders,
    outbox_tests::mysql,
    sqlx::MySqlConnection,
    "?",
    outbox_tests::mysql::count
);
