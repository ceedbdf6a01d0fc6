//! The consumer's contract in dedup mode on Kafka, one suite run on each database a consumer
//! commits to (PostgreSQL; MariaDB, the machine's 10.11): every event delivered twice takes
//! effect once; poison messages are dead-lettered and their partition flows; a failing handler
//! undoes only its own work, retried in place or through the retry topic; a stop commits the
//! offsets of committed work and takes no batch after the one in hand; a consumer killed after
//! its commit, before its offsets, applies each once; a panicking handler
//! is a failure, not a crash; two groups with handlers of the same name each do their work; a
//! retried message does not hold up its partition; messages waiting in the retry topic survive
//! a restart. What differs by database is in `consumer.rs`, `consumer_faults.rs` (PostgreSQL)
//! and `consumer_mysql.rs` (MariaDB); inbox mode is PostgreSQL's only so far.

use std::time::Duration;

use outbox_tests::kafka::Kafka;
use outbox_tests::payments::PARTITIONS;

/// Waits until `group` committed `total` offsets on the payments' topic.
async fn all_committed(kafka: &Kafka, group: &str, total: i64) {
    let topic = outbox_tests::fixtures::PAYMENTS;
    outbox_tests::payments::wait_for(
        &format!("{group}: every message consumed and committed"),
        Duration::from_secs(60),
        || async {
            outbox_tests::kafka::committed_total(&kafka.bootstrap(), group, topic, PARTITIONS)
                == total
        },
    )
    .await;
}

/// The suite, for one database: `$db` its test database type (a `pool` field), `$setup` what
/// makes one with the `orders` table and the payments' topics on a given cluster, `$conn` its
/// connection type, `$p1` how its SQL spells the first bound parameter, `$count` its counting
/// query.
macro_rules! consumer_suite {
    ($name:ident, $db:ty, $setup:path, $conn:ty, $p1:literal, $count:path) => {
        pub(crate) mod $name {
            use std::time::Duration;

            use outbox_runtime::inbox::{Consumer, ConsumerBuilder, RetryPolicy};
            use outbox_tests::fixtures::{PaymentRefunded, PaymentSucceeded, PAYMENTS};
            use outbox_tests::kafka::{committed_total, consume, produce, Kafka, Outgoing};
            use outbox_tests::payments::{
                dead_letters, produce_in_one_partition, read_at, records, retried, wait_for,
                PARTITIONS,
            };
            use outbox_tests::stopping;
            use outbox_tests::Running;
            use rdkafka::ClientConfig;
            use uuid::Uuid;

            use super::all_committed;

            /// A test's database and the mock cluster.
            async fn setup() -> ($db, Kafka) {
                $setup(Kafka::mock()).await
            }

            /// A consumer of `group`, quick to commit offsets and to retry.
            fn builder(db: &$db, kafka: &Kafka, group: &str) -> ConsumerBuilder<(), Database> {
                let mut config = ClientConfig::new();
                config.set("auto.commit.interval.ms", "100");
                Consumer::builder(db.pool.clone())
                    .brokers(kafka.bootstrap())
                    .group_id(group)
                    .consumer_config(config)
                    .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
            }

            outbox_tests::payments_kit!($db, $conn, $p1);

            /// Every payment and ten refunds produced once, then again in the opposite order:
            /// each takes effect once, its dedup row under the group's name.
            pub(crate) async fn delivered_twice((db, kafka): ($db, Kafka)) {
                let payments = plain_payments(&db, 100).await;
                let mut once = records(&payments);
                once.extend(payments.iter().take(10).map(|(_, p)| {
                    let refund = PaymentRefunded {
                        payment_id: p.payment_id,
                        order_id: p.order_id,
                    };
                    Outgoing::event(&refund, Uuid::now_v7())
                }));
                let mut twice = once.clone();
                twice.extend(once.iter().rev().cloned());
                produce(&kafka.bootstrap(), PAYMENTS, &twice).await;
                let consumer = builder(&db, &kafka, "orders")
                    .handler(mark_paid)
                    .handler(mark_refunded)
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                all_committed(&kafka, "orders", twice.len() as i64).await;
                running.stop().await;
                assert_eq!(
                    paid(&db, &payments).await,
                    vec![1; 100],
                    "each payment once"
                );
                assert_eq!(
                    $count(&db.pool, "SELECT COUNT(*) FROM orders WHERE refunded = 1").await,
                    10
                );
                assert_eq!(marked(&db, "orders/mark_paid").await, 100);
                assert_eq!(marked(&db, "orders/mark_refunded").await, 10);
                assert_eq!(
                    $count(&db.pool, "SELECT COUNT(*) FROM processed_event").await,
                    110,
                    "dedup keys are the consumer group's"
                );
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn every_event_delivered_twice_takes_effect_once() {
                delivered_twice(setup().await).await;
            }

            /// Poison among good messages on one partition: a payload not JSON, a message
            /// without an `event_id`, a payload of the wrong shape, a permanent failure. Each is
            /// dead-lettered with its reason, as it came; the good ones around them are handled.
            pub(crate) async fn poison((db, kafka): ($db, Kafka)) {
                let payments = plain_payments(&db, 2).await;
                let key = "one-partition".to_owned();
                let good = |i: usize| {
                    let mut r = Outgoing::event(&payments[i].1, payments[i].0);
                    r.key = key.clone();
                    r
                };
                let mut not_json = good(0);
                not_json.payload = b"{not json".to_vec();
                not_json.headers[0].1 = Uuid::now_v7().to_string();
                let mut no_event_id = good(0);
                no_event_id.headers.remove(0);
                let mut wrong_shape = good(0);
                wrong_shape.payload = br#"{"payment_id": "not-a-uuid"}"#.to_vec();
                wrong_shape.headers[0].1 = Uuid::now_v7().to_string();
                let negative = PaymentSucceeded {
                    amount: -5,
                    ..payments[0].1.clone()
                };
                let mut refused = Outgoing::event(&negative, Uuid::now_v7());
                refused.key = key.clone();
                let records = vec![
                    good(0),
                    not_json,
                    no_event_id,
                    wrong_shape,
                    refused,
                    good(1),
                ];
                produce(&kafka.bootstrap(), PAYMENTS, &records).await;
                let consumer = builder(&db, &kafka, "orders")
                    .handler(mark_paid)
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                let dead = dead_letters(&kafka, 4, Duration::from_secs(30)).await;
                all_committed(&kafka, "orders", 6).await;
                running.stop().await;
                assert_eq!(paid(&db, &payments).await, [1, 1], "both good ones applied");
                let errors: Vec<&str> = dead.iter().map(|r| r.header("dlq_error")).collect();
                assert_eq!(dead.len(), 4, "{errors:?}");
                assert!(
                    errors[0].starts_with("payload is not JSON"),
                    "{}",
                    errors[0]
                );
                assert_eq!(
                    errors[1],
                    "message has no event_id header (nor a CloudEvents ce_id)"
                );
                let shape = "does not deserialize into `outbox_tests::fixtures::PaymentSucceeded`";
                assert!(errors[2].contains(shape), "{}", errors[2]);
                assert!(
                    errors[3].contains("handler `mark_paid` failed for good: negative amount -5"),
                    "{}",
                    errors[3]
                );
                for (r, original) in dead.iter().zip(&records[1..5]) {
                    assert_eq!(r.key, original.key);
                    assert_eq!(r.raw, original.payload);
                    assert_eq!(r.header("dlq_source_topic"), PAYMENTS);
                    for (k, v) in &original.headers {
                        assert_eq!(r.header(k), v, "original header {k} kept");
                    }
                }
                assert_eq!(
                    $count(&db.pool, "SELECT COUNT(*) FROM processed_event").await,
                    2,
                    "no dedup row of a failed message"
                );
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn poison_messages_go_to_the_dead_letter_topic_and_the_partition_flows() {
                poison(setup().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shutdown_commits_the_offsets_of_committed_work() {
                let (db, kafka) = setup().await;
                let payments = plain_payments(&db, 50).await;
                produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
                let mut never = ClientConfig::new();
                never.set("auto.commit.interval.ms", "3600000");
                let consumer = builder(&db, &kafka, "orders")
                    .consumer_config(never)
                    .handler(mark_paid)
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                wait_for("50 applied", Duration::from_secs(30), || async {
                    paid(&db, &payments).await == vec![1; 50]
                })
                .await;
                let committed = || committed_total(&kafka.bootstrap(), "orders", PAYMENTS, PARTITIONS);
                assert_eq!(committed(), 0);
                running.stop().await;
                assert_eq!(committed(), 50);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stopped_consumer_finishes_the_batch_in_hand_and_no_more_of_its_backlog() {
                let (db, kafka) = setup().await;
                let payments = plain_payments(&db, 2_000).await;
                produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
                // The mock lets a group's next member in only after the last one's session
                // timeout (librdkafka's default 45 s): a short one keeps the eight restarts
                // short.
                let mut short_session = ClientConfig::new();
                short_session.set("session.timeout.ms", "6000");
                let start = |counted| {
                    builder(&db, &kafka, "orders")
                        .consumer_config(short_session.clone())
                        .state(counted)
                        .handler(mark_paid_counted)
                        .batch_size(stopping::BATCH)
                        .build()
                        .unwrap()
                };
                stopping::stops_after_the_batch_in_hand(2_000, start, |sql| {
                    $count(&db.pool, sql)
                })
                .await;
            }

            /// A consumer process killed (SIGKILL) after its batches committed and before any
            /// offset commit: the next one is given every message again, and each payment still
            /// takes effect once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_consumer_killed_after_its_commit_before_its_offsets_applies_each_once() {
                let (db, kafka) = setup().await;
                let payments = plain_payments(&db, 300).await;
                produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
                let start = |commit_interval_ms: &str| {
                    outbox_tests::ChildGuard(
                        std::process::Command::new(env!("CARGO_BIN_EXE_outbox-test-consumer"))
                            .args([&db.url, &kafka.bootstrap(), "orders", commit_interval_ms])
                            .spawn()
                            .expect("start consumer process"),
                    )
                };
                let committed = || committed_total(&kafka.bootstrap(), "orders", PAYMENTS, PARTITIONS);
                // This one never commits offsets on its own.
                let mut child = start("3600000");
                wait_for("all 300 applied", Duration::from_secs(60), || async {
                    paid(&db, &payments).await == vec![1; 300]
                })
                .await;
                child.kill();
                assert_eq!(committed(), 0, "killed before any offset commit");
                let mut child = start("100");
                wait_for(
                    "the redelivered 300 consumed",
                    Duration::from_secs(60),
                    || async { committed() == 300 },
                )
                .await;
                child.kill();
                assert_eq!(
                    paid(&db, &payments).await,
                    vec![1; 300],
                    "effects still once"
                );
            }

            /// Three flaky payments among twenty others on one partition, so that they share
            /// batches: each takes effect once, the failed attempts and batch-mates leave
            /// nothing twice; through the retry topic, each is retried after its first and
            /// second failure with where the original was read.
            async fn failing_twice(policy: RetryPolicy) {
                let (db, kafka) = setup().await;
                let payments = plain_payments(&db, 3).await;
                let others = plain_payments(&db, 20).await;
                // The others succeed at once: their calls are counted from the third.
                for (_, p) in &others {
                    FLAKY_CALLS.lock().unwrap().insert(p.order_id, 2);
                }
                let mut all = payments.clone();
                all.extend(others.iter().cloned());
                all.rotate_left(1);
                // Retried in place: all on one partition, so that the flaky ones share
                // batches. Through the retry topic: each under its own key, so that where a
                // copy says its original was read is not where the copy itself is (the retry
                // topic has as many partitions, and a copy keeps its key).
                let produced = match policy {
                    RetryPolicy::InPlace => produce_in_one_partition(&kafka, &all).await,
                    _ => {
                        let produced = records(&all);
                        produce(&kafka.bootstrap(), PAYMENTS, &produced).await;
                        produced
                    }
                };
                let consumer = builder(&db, &kafka, "orders")
                    .handler(flaky)
                    .retry_policy(policy)
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                wait_for("every order paid", Duration::from_secs(60), || async {
                    paid(&db, &all).await == vec![1; 23]
                })
                .await;
                all_committed(&kafka, "orders", produced.len() as i64).await;
                running.stop().await;
                assert_eq!(
                    paid(&db, &payments).await,
                    [1, 1, 1],
                    "failed attempts left nothing"
                );
                assert_eq!(
                    paid(&db, &others).await,
                    vec![1; 20],
                    "batch-mates applied once"
                );
                // A handler may run again when a batch-mate fails (the straight pass given
                // up, its work rolled back): at least three calls each, one effect.
                for (_, p) in &payments {
                    assert!(flaky_calls(p.order_id) >= 3);
                }
                let expected = match policy {
                    RetryPolicy::InPlace => 0,
                    _ => 6,
                };
                let retried = retried(&kafka, expected).await;
                assert_eq!(retried.len(), expected, "messages sent to the retry topic");
                if policy == RetryPolicy::InPlace {
                    return;
                }
                let originals = read_at(&kafka, all.len()).await;
                for (event_id, _) in &payments {
                    let copies: Vec<_> = retried
                        .iter()
                        .filter(|r| r.header("event_id") == event_id.to_string())
                        .collect();
                    let mut attempts: Vec<&str> = copies
                        .iter()
                        .map(|r| r.header("outbox_retry_attempts"))
                        .collect();
                    attempts.sort_unstable();
                    assert_eq!(attempts, ["1", "2"], "retried after each failure");
                    for r in copies {
                        assert_eq!(r.header("outbox_retry_source_topic"), PAYMENTS);
                        // Where the original was read, also on the copy of a copy.
                        let (partition, offset) = &originals[&event_id.to_string()];
                        assert_eq!(r.header("outbox_retry_source_partition"), partition);
                        assert_eq!(r.header("outbox_retry_source_offset"), offset);
                        assert!(r
                            .header("outbox_retry_error")
                            .contains("the payment service is busy"));
                    }
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_failing_handler_undoes_only_its_own_work_retried_in_place() {
                failing_twice(RetryPolicy::InPlace).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_failing_handler_undoes_only_its_own_work_through_the_retry_topic() {
                failing_twice(RetryPolicy::Topic).await;
            }

            /// A panicking handler is a failure like any other: retried (it then succeeds),
            /// its effect once, with the panic's message; the consumer keeps running.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_panicking_handler_is_a_failure_not_a_crash() {
                let (db, kafka) = setup().await;
                let payments = orders_with_payments(&db, 10, |i| i % 5 == 0, 13).await;
                produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
                let consumer = builder(&db, &kafka, "orders")
                    .handler(panicky)
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                wait_for("every payment applied", Duration::from_secs(30), || async {
                    paid(&db, &payments).await == vec![1; 10]
                })
                .await;
                // More messages after the panics: the consumer is still there.
                let more = plain_payments(&db, 5).await;
                produce(&kafka.bootstrap(), PAYMENTS, &records(&more)).await;
                wait_for(
                    "the later payments applied",
                    Duration::from_secs(30),
                    || async { paid(&db, &more).await == vec![1; 5] },
                )
                .await;
                assert!(!running.is_finished(), "the consumer is still running");
                running.stop().await;
                assert_eq!(paid(&db, &payments).await, vec![1; 10], "each payment once");
                assert_eq!(paid(&db, &more).await, vec![1; 5], "each payment once");
                for (_, p) in payments.iter().filter(|(_, p)| p.amount == 13) {
                    assert!(PANICKY_CALLS.lock().unwrap()[&p.order_id] >= 2);
                }
                let errors: Vec<String> = retried(&kafka, 2)
                    .await
                    .iter()
                    .map(|r| r.header("outbox_retry_error").to_owned())
                    .collect();
                assert_eq!(errors.len(), 2, "{errors:?}");
                for e in errors {
                    assert!(
                        e.contains("panicked: the payment provider's client panicked"),
                        "{e}"
                    );
                }
            }

            /// Two services (two consumer groups) on one database, with handlers of the same
            /// name for the same event: each does its own work. Their batches update the same
            /// orders: deadlocks are likely, and retried.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn handlers_of_the_same_name_in_two_groups_do_not_skip_each_other() {
                let (db, kafka) = setup().await;
                let payments = plain_payments(&db, 20).await;
                produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
                let consumers: Vec<_> = ["billing", "shipping"]
                    .iter()
                    .map(|group| {
                        Running::consumer(
                            &builder(&db, &kafka, group)
                                .handler(mark_paid)
                                .build()
                                .unwrap(),
                        )
                    })
                    .collect();
                wait_for(
                    "each group paid each order",
                    Duration::from_secs(30),
                    || async { paid(&db, &payments).await == vec![2; 20] },
                )
                .await;
                for group in ["billing", "shipping"] {
                    all_committed(&kafka, group, 20).await;
                }
                Running::stop_all(consumers).await;
                assert_eq!(
                    paid(&db, &payments).await,
                    vec![2; 20],
                    "each group paid once"
                );
            }

            /// A message whose handler fails twice goes through the retry topic: its
            /// partition's other messages are handled meanwhile, and it once, on its third
            /// attempt.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_retried_message_does_not_hold_up_its_partition() {
                let (db, kafka) = setup().await;
                let payments = orders_with_payments(&db, 6, |i| i == 0, 7).await;
                produce_in_one_partition(&kafka, &payments).await;
                let consumer = builder(&db, &kafka, "orders")
                    .handler(sometimes_failing)
                    .retry_backoff(Duration::from_millis(300), Duration::from_secs(1))
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                wait_for("every payment applied", Duration::from_secs(30), || async {
                    paid(&db, &payments).await == vec![1; 6]
                })
                .await;
                running.stop().await;
                let handled: Vec<Uuid> = HANDLED
                    .lock()
                    .unwrap()
                    .iter()
                    .copied()
                    .filter(|id| payments.iter().any(|(_, p)| p.order_id == *id))
                    .collect();
                let first = payments[0].1.order_id;
                assert_eq!(handled.len(), 6, "each handled once");
                assert_eq!(handled.last(), Some(&first), "the failing one handled last");
                assert_eq!(paid(&db, &payments).await, vec![1; 6]);
                assert_eq!(flaky_calls(first), 3, "handled on its third attempt");
            }

            /// A consumer stopped while messages wait in the retry topic: the next one (same
            /// group) handles them when they are due; none lost, none handled twice, none
            /// dead-lettered.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn messages_waiting_in_the_retry_topic_survive_a_consumer_restart() {
                let (db, kafka) = setup().await;
                let payments = orders_with_payments(&db, 6, |i| i % 3 == 0, 7).await;
                produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
                let start = || {
                    builder(&db, &kafka, "orders")
                        .handler(sometimes_failing)
                        .retry_backoff(Duration::from_secs(3), Duration::from_secs(3))
                        .build()
                        .unwrap()
                };
                let first = Running::consumer(&start());
                let retry_topic = format!("{PAYMENTS}.retry");
                consume(
                    &kafka.bootstrap(),
                    &retry_topic,
                    PARTITIONS,
                    Duration::from_secs(30),
                    |r| r.len() >= 2,
                )
                .await;
                let sevens: Vec<_> = payments
                    .iter()
                    .filter(|(_, p)| p.amount == 7)
                    .cloned()
                    .collect();
                let others: Vec<_> = payments
                    .iter()
                    .filter(|(_, p)| p.amount != 7)
                    .cloned()
                    .collect();
                wait_for("the other four paid", Duration::from_secs(30), || async {
                    paid(&db, &others).await == vec![1; 4]
                })
                .await;
                first.stop().await;
                for (_, p) in &sevens {
                    assert_eq!(
                        flaky_calls(p.order_id),
                        1,
                        "stopped before its retry was due"
                    );
                }
                let second = Running::consumer(&start());
                wait_for("every payment applied", Duration::from_secs(60), || async {
                    paid(&db, &payments).await == vec![1; 6]
                })
                .await;
                wait_for(
                    "the retry topic consumed",
                    Duration::from_secs(30),
                    || async {
                        outbox_tests::kafka::committed_total(
                            &kafka.bootstrap(),
                            "orders",
                            &retry_topic,
                            PARTITIONS,
                        ) == 4
                    },
                )
                .await;
                second.stop().await;
                assert_eq!(paid(&db, &payments).await, vec![1; 6]);
                for (_, p) in &sevens {
                    assert_eq!(flaky_calls(p.order_id), 3, "handled on its third attempt");
                }
                let dead = dead_letters(&kafka, 1, Duration::from_secs(1)).await;
                assert!(dead.is_empty(), "nothing dead-lettered");
            }
        }
    };
}

consumer_suite!(
    postgres,
    outbox_tests::TestDb,
    outbox_tests::payments::setup_on,
    sqlx::PgConnection,
    "$1",
    outbox_tests::count
);

consumer_suite!(
    mariadb,
    outbox_tests::mysql::MySqlTestDb,
    outbox_tests::mysql::payments_setup_on,
    sqlx::MySqlConnection,
    "?",
    outbox_tests::mysql::count
);

// On tansu, the real broker process, too.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_every_event_delivered_twice_takes_effect_once_on_tansu() {
    let kafka = Kafka::tansu().await;
    postgres::delivered_twice(outbox_tests::payments::setup_on(kafka).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_every_event_delivered_twice_takes_effect_once_on_tansu() {
    let kafka = Kafka::tansu().await;
    mariadb::delivered_twice(outbox_tests::mysql::payments_setup_on(kafka).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_poison_messages_go_to_the_dead_letter_topic_and_the_partition_flows_on_tansu() {
    let kafka = Kafka::tansu().await;
    postgres::poison(outbox_tests::payments::setup_on(kafka).await).await;
}
