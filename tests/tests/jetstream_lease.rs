//! A JetStream consumer group's lease on a topic, one suite run on each database the lease
//! lives in (PostgreSQL: one row, `FOR KEY SHARE`; MariaDB: a lease row and a fence row), each
//! test with its own nats-server: several instances handle each event once, in each key's
//! order; a crashed instance is replaced and a stopped one hands over, what either held coming
//! first; a batch longer than `ack_wait` keeps its lease beside a standby; a lease the
//! database refuses is warned of. What differs by database (taking the lease over under a
//! running batch) is in `consumer_jetstream.rs` and `consumer_mysql_jetstream.rs`.

/// The suite, for one database: `$db` its test database type (with `new()` and `pool`),
/// `$steps` the module with its `create_steps`, `record_step`, `insert_step` and `steps`,
/// `$conn` its connection type, `$count` its counting query, `$status` its `status`.
macro_rules! lease_suite {
    ($name:ident, $db:ty, $steps:path, $conn:ty, $count:path, $status:path) => {
        mod $name {
            use std::sync::atomic::{AtomicBool, Ordering};
            use std::time::Duration;

            use outbox_runtime::inbox::{Consumer, ConsumerBuilder, HandlerError};
            use outbox_runtime::relay::JetStream;
            use outbox_tests::deposits::{interleaved, Deposited, TOPIC};
            use outbox_tests::nats::{publish_with, NatsServer};
            use outbox_tests::payments::wait_for;
            use outbox_tests::Running;
            use $steps as steps_db;

            const STREAM: &str = "ACCOUNTS";

            /// A test's database with the steps table, and its own server with the stream.
            async fn setup() -> ($db, NatsServer) {
                let db = <$db>::new().await;
                steps_db::create_steps(&db.pool).await;
                let server = NatsServer::start().await;
                server.create_stream(STREAM, TOPIC, |_| {}).await;
                (db, server)
            }

            /// A consumer of group `group`, reading `server`'s JetStream (a lease of 2 s).
            async fn builder(
                db: &$db,
                server: &NatsServer,
                group: &str,
            ) -> ConsumerBuilder<(), <$conn as sqlx::Connection>::Database> {
                Consumer::builder(db.pool.clone())
                    .jetstream(
                        JetStream::new(server.client().await).ack_wait(Duration::from_secs(2)),
                    )
                    .group_id(group)
                    .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
            }

            /// Waits until group `group` has settled every message of the stream.
            async fn wait_settled(server: &NatsServer, group: &str) {
                let durable = format!("{group}_{}", TOPIC.replace('.', "_"));
                wait_for("every message settled", Duration::from_secs(60), || async {
                    server.unsettled(STREAM, &durable).await == Some((0, 0))
                })
                .await;
            }

            /// Every account's steps, `0..seqs` each, in order.
            async fn assert_in_order(db: &$db, accounts: usize, seqs: i64) {
                let steps = steps_db::steps(&db.pool).await;
                assert_eq!(steps.len(), accounts);
                for (account, handled) in steps {
                    assert_eq!(
                        handled,
                        (0..seqs).collect::<Vec<i64>>(),
                        "account {account}"
                    );
                }
            }

            /// The group's lease as `outbox status` shows it: (owned, seconds until it expires).
            async fn lease(db: &$db, group: &str) -> (bool, Option<f64>) {
                let leases = $status(&db.pool).await.unwrap().consumer_leases;
                assert_eq!(leases.len(), 1, "{leases:?}");
                let lease = leases
                    .iter()
                    .find(|l| l.group == group)
                    .unwrap_or_else(|| panic!("no lease of {group}: {leases:?}"));
                assert_eq!(lease.topic, TOPIC);
                (lease.owned, lease.expires_in_secs)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn three_instances_handle_each_event_once_in_each_keys_order() {
                let (db, server) = setup().await;
                // 10 accounts' events interleaved, then all of them again: a batch (25) holds
                // events of several accounts, and every event comes twice.
                let records = interleaved(10, 30);
                let mut twice = records.clone();
                twice.extend(records.iter().cloned());
                let mut running = Vec::new();
                for _ in 0..3 {
                    let consumer = builder(&db, &server, "ledger")
                        .await
                        .handler(steps_db::record_step)
                        .batch_size(25)
                        .build()
                        .unwrap();
                    running.push(Running::consumer(&consumer));
                }
                server.publish(TOPIC, &twice).await;
                wait_settled(&server, "ledger").await;
                let (owned, expires_in) = lease(&db, "ledger").await;
                assert!(
                    owned && expires_in.is_some_and(|s| s > 0.0),
                    "{expires_in:?}"
                );
                Running::stop_all(running).await;
                assert_in_order(&db, 10, 30).await;
                let pairs = $count(&db.pool, "SELECT count(*) FROM processed_event").await;
                assert_eq!(pairs, 300);
                // Given up as the instances stopped.
                assert_eq!(lease(&db, "ledger").await, (false, None));
            }

            /// A handler recording the step, slow (300 ms) over every tenth event of account 0,
            /// saying so meanwhile in a flag of its own (for a handover's timing: each test
            /// its own, as they run side by side).
            macro_rules! slow_step {
                ($handler:ident, $flag:ident) => {
                    static $flag: AtomicBool = AtomicBool::new(false);

                    #[outbox_runtime::inbox_handler]
                    async fn $handler(
                        event: Deposited,
                        tx: &mut $conn,
                    ) -> Result<(), HandlerError> {
                        if event.account == "acct-0" && event.seq.is_multiple_of(10) {
                            $flag.store(true, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(300)).await;
                            $flag.store(false, Ordering::SeqCst);
                        }
                        steps_db::insert_step(tx, &event).await
                    }
                };
            }
            slow_step!(slow_step_crashed, IN_SLOW_CALL_CRASHED);
            slow_step!(slow_step_stopped, IN_SLOW_CALL_STOPPED);

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_crashed_instance_is_replaced_and_what_it_held_comes_first() {
                // Mid-batch, as `kill -9`: its lease and the messages it holds are left as
                // they are, its batch's transaction rolled back with its connection.
                handover(Running::abort, slow_step_crashed, &IN_SLOW_CALL_CRASHED).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stopped_instance_hands_over_and_what_it_fetched_comes_first() {
                // It finishes its batch and gives the lease up; what it had fetched beyond
                // that batch is still delivered to it, not settled.
                let end = |first: Running| {
                    first.cancel();
                    tokio::spawn(first.stop());
                };
                handover(end, slow_step_stopped, &IN_SLOW_CALL_STOPPED).await;
            }

            /// An instance that ends (`end`) in the middle of a slow batch of `handler` (in a
            /// slow call while `in_slow_call`), while events keep coming and a second one
            /// stands by: every account's events are handled once each, in order, and the
            /// second gives the lease up when it stops.
            async fn handover<H>(end: impl FnOnce(Running), handler: H, in_slow_call: &AtomicBool)
            where
                H: outbox_runtime::inbox::Handler<(), <$conn as sqlx::Connection>::Database> + Copy,
            {
                let (db, server) = setup().await;
                let consumer = || async {
                    builder(&db, &server, "ledger")
                        .await
                        .handler(handler)
                        .batch_size(25)
                        .build()
                        .unwrap()
                };
                let first = Running::consumer(&consumer().await);
                // Events keep coming, ten at a time (as a service writes them), while the
                // first instance works and ends, and the second takes over.
                let publishing = {
                    let url = server.url();
                    tokio::spawn(async move {
                        let client = async_nats::connect(url).await.unwrap();
                        let js = async_nats::jetstream::new(client);
                        for ten in interleaved(10, 60).chunks(10) {
                            publish_with(&js, TOPIC, ten).await;
                            tokio::time::sleep(Duration::from_millis(20)).await; // its pace
                        }
                    })
                };
                let second = Running::consumer(&consumer().await); // stands by
                let pool = db.pool.clone();
                wait_for(
                    "the first instance at work",
                    Duration::from_secs(30),
                    || async {
                        $count(&pool, "SELECT count(*) FROM steps").await >= 100
                            && in_slow_call.load(Ordering::SeqCst)
                    },
                )
                .await;
                end(first);
                publishing.await.unwrap();
                wait_settled(&server, "ledger").await;
                second.stop().await;
                assert_in_order(&db, 10, 60).await;
                assert_eq!(lease(&db, "ledger").await, (false, None));
            }

            /// The step recorded; takes 3 s over account 1's third event (longer than the
            /// tests' `ack_wait` of 2 s, and than the lease).
            #[outbox_runtime::inbox_handler]
            async fn record_step_slowly_once(
                event: Deposited,
                tx: &mut $conn,
            ) -> Result<(), HandlerError> {
                if event.account == "acct-1" && event.seq == 2 {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                }
                steps_db::insert_step(tx, &event).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_batch_longer_than_ack_wait_keeps_its_lease_beside_a_standby() {
                let (db, server) = setup().await;
                server.publish(TOPIC, &interleaved(4, 5)).await;
                let mut running = Vec::new();
                for _ in 0..2 {
                    let consumer = builder(&db, &server, "ledger")
                        .await
                        .handler(record_step_slowly_once)
                        .build()
                        .unwrap();
                    running.push(Running::consumer(&consumer));
                }
                wait_settled(&server, "ledger").await;
                Running::stop_all(running).await;
                assert_in_order(&db, 4, 5).await;
            }

            /// A lease the database refuses (its table gone: a migration not run; a privilege
            /// missing; a server too old for `SKIP LOCKED`) is warned of, not waited on in
            /// silence: the consumer reads nothing until it is mended.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_lease_the_database_refuses_is_warned_of() {
                let log = super::log();
                let (db, server) = setup().await;
                sqlx::query("DROP TABLE outbox_consumer_lease")
                    .execute(&db.pool)
                    .await
                    .unwrap();
                let group = concat!(stringify!($name), "-refused");
                let consumer = builder(&db, &server, group)
                    .await
                    .handler(steps_db::record_step)
                    .build()
                    .unwrap();
                let running = Running::consumer(&consumer);
                server.publish(TOPIC, &interleaved(1, 3)).await;
                let said = format!("group={group}");
                wait_for("the refusal warned of", Duration::from_secs(30), || async {
                    log.text().lines().any(|line| {
                        line.contains("WARN")
                            && line.contains(&said)
                            && line.contains("outbox_consumer_lease")
                    })
                })
                .await;
                assert!(!running.is_finished(), "the consumer goes on trying");
                running.stop().await;
                assert_eq!($count(&db.pool, "SELECT COUNT(*) FROM steps").await, 0);
            }
        }
    };
}

/// This test binary's log at `WARN` (each test finds its own group's lines).
fn log() -> &'static outbox_tests::log::Log {
    static LOG: std::sync::OnceLock<outbox_tests::log::Log> = std::sync::OnceLock::new();
    LOG.get_or_init(|| outbox_tests::log::Log::install(tracing::Level::WARN))
}

lease_suite!(
    postgres,
    outbox_tests::TestDb,
    outbox_tests::deposits,
    sqlx::PgConnection,
    outbox_tests::count,
    outbox_runtime::admin::status
);

lease_suite!(
    mariadb,
    outbox_tests::mysql::MySqlTestDb,
    outbox_tests::mysql,
    sqlx::MySqlConnection,
    outbox_tests::mysql::count,
    outbox_runtime::mysql::status
);
