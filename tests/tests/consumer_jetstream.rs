//! Consumers from NATS JetStream, against real `nats-server` processes (one per test): the same
//! promises as on Kafka. Exactly-once effects over redelivery, retries redelivered after their
//! backoff without holding the others, dead letters with their reason, panics, the inbox mode,
//! a lease taken over under a running batch, the server killed mid-consumption, and the
//! broker-loss drill (the stream purged, `replay` restores it, nothing is done twice). Per-key
//! order with several consumers, crashes and handovers are `jetstream_lease.rs`'s suite, run on
//! PostgreSQL and MariaDB.

use std::time::Duration;

use outbox_runtime::admin::{Replay, ReplayFilter};
use outbox_runtime::inbox::{Consumer, ConsumerBuilder, HandlerError, Mode, RetryPolicy};
use outbox_runtime::relay::{JetStream, Relay};
use outbox_tests::deposits::{
    create_steps, emit_events, insert_step, interleaved, record_step, steps, wait_until_published,
    Deposited, TOPIC,
};
use outbox_tests::fixtures::{self, PaymentSucceeded, PAYMENTS};
use outbox_tests::kafka::Outgoing;
use outbox_tests::log::Log;
use outbox_tests::nats::NatsServer;
use outbox_tests::payments::{not_json, orders_with_payments, paid_counts, records, wait_for};
use outbox_tests::{count, Running, TestDb};

/// The payments stream, and its dead letters'.
const STREAM: &str = "PAYMENTS";
const DEAD_LETTERS: &str = "PAYMENTS_DLQ";

/// A test's database with the orders table, and its own server with the payments streams.
async fn setup() -> (TestDb, NatsServer) {
    let db = TestDb::new().await;
    fixtures::create_orders(&db.pool).await;
    let server = NatsServer::start().await;
    server.create_stream(STREAM, PAYMENTS, |_| {}).await;
    let dlq = format!("{PAYMENTS}.dlq");
    server.create_stream(DEAD_LETTERS, &dlq, |_| {}).await;
    (db, server)
}

/// A test's database with the steps table, and its own server with the accounts stream.
async fn accounts_setup() -> (TestDb, NatsServer) {
    let db = TestDb::new().await;
    create_steps(&db.pool).await;
    let server = NatsServer::start().await;
    server.create_stream("ACCOUNTS", TOPIC, |_| {}).await;
    (db, server)
}

/// A consumer of group `group` reading `server`'s JetStream, quick to retry.
async fn builder(db: &TestDb, server: &NatsServer, group: &str) -> ConsumerBuilder {
    Consumer::builder(db.pool.clone())
        .jetstream(JetStream::new(server.client().await).ack_wait(Duration::from_secs(2)))
        .group_id(group)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
}

/// Waits until group `group` has settled every message of `stream` (acknowledged or
/// terminated, none waiting).
async fn wait_settled(server: &NatsServer, stream: &str, group: &str, topic: &str) {
    let durable = format!("{group}_{}", topic.replace('.', "_"));
    wait_for("every message settled", Duration::from_secs(60), || async {
        server.unsettled(stream, &durable).await == Some((0, 0))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_that_cannot_work_are_refused_with_what_to_change() {
    let db = TestDb::new().await;
    let server = NatsServer::start().await;
    let refused = |result: outbox_runtime::Result<Consumer>| match result {
        Err(outbox_runtime::Error::Config(message)) => message,
        other => panic!("expected a configuration error, got {other:?}"),
    };
    let both = builder(&db, &server, "orders")
        .await
        .brokers("127.0.0.1:9092")
        .handler(fixtures::mark_order_paid)
        .build();
    assert!(refused(both).contains("both Kafka brokers and JetStream"));
    let short = Consumer::builder(db.pool.clone())
        .jetstream(JetStream::new(server.client().await).ack_wait(Duration::from_millis(500)))
        .group_id("orders")
        .handler(fixtures::mark_order_paid)
        .build();
    assert!(refused(short).contains("ack_wait must be at least 1 s"));
    let no_group = Consumer::builder(db.pool.clone())
        .jetstream(JetStream::new(server.client().await))
        .handler(fixtures::mark_order_paid)
        .build();
    assert!(refused(no_group).contains("group_id"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_delivered_twice_takes_effect_once() {
    let (db, server) = setup().await;
    let payments = orders_with_payments(&db.pool, 100).await;
    let records = records(&payments);
    // Everything once, then everything again in the opposite order.
    let mut twice = records.clone();
    twice.extend(records.iter().rev().cloned());
    server.publish(PAYMENTS, &twice).await;

    let consumer = builder(&db, &server, "orders")
        .await
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_settled(&server, STREAM, "orders", PAYMENTS).await;
    running.stop().await;
    assert_eq!(paid_counts(&db.pool).await, vec![1; 100]);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM processed_event").await,
        100
    );
    assert!(server.read_stream(DEAD_LETTERS).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_message_is_redelivered_after_its_backoff_without_holding_the_others() {
    let (db, server) = setup().await;
    let payments = outbox_tests::payments::orders_with_special_payments(
        &db.pool,
        30,
        |i| i % 10 == 0,
        7, // fails twice, then succeeds
    )
    .await;
    server.publish(PAYMENTS, &records(&payments)).await;
    let consumer = builder(&db, &server, "orders")
        .await
        .handler(fixtures::sometimes_failing_mark_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_settled(&server, STREAM, "orders", PAYMENTS).await;
    running.stop().await;
    assert_eq!(paid_counts(&db.pool).await, vec![1; 30]);
    for (i, (_, payment)) in payments.iter().enumerate() {
        let calls = fixtures::flaky_calls(payment.order_id);
        assert_eq!(calls, if i % 10 == 0 { 3 } else { 0 }, "payment {i}");
    }
    // Each failing payment was handled after the one published right after it: redelivered
    // later, it held nothing up.
    let handled = fixtures::HANDLED.lock().unwrap().clone();
    let at = |order| handled.iter().position(|o| *o == order).unwrap();
    for i in [0, 10, 20] {
        assert!(
            at(payments[i].1.order_id) > at(payments[i + 1].1.order_id),
            "payment {i} was handled before the next one"
        );
    }
    assert!(server.read_stream(DEAD_LETTERS).await.is_empty());
}

/// Marks the order paid and records it in `handled` (what commits, in the order it commits);
/// fails its first two attempts at a payment of 7.
#[outbox_runtime::inbox_handler]
async fn pay_failing_twice_on_seven(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
    meta: &outbox_runtime::inbox::MessageMeta<'_>,
) -> Result<(), HandlerError> {
    if event.amount == 7 && meta.attempt() <= 2 {
        return Err(HandlerError::retryable("the payment service is busy"));
    }
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(&mut *tx)
        .await?;
    sqlx::query("INSERT INTO handled (order_id, attempt) VALUES ($1, $2)")
        .bind(event.order_id)
        .bind(meta.attempt() as i32)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_place_retries_keep_the_order_they_came_in() {
    let (db, server) = setup().await;
    sqlx::query(
        "CREATE TABLE handled (n bigserial PRIMARY KEY, order_id uuid NOT NULL, attempt int NOT NULL)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let payments = outbox_tests::payments::orders_with_special_payments(
        &db.pool,
        30,
        |i| i % 10 == 4,
        7, // fails twice, then succeeds
    )
    .await;
    server.publish(PAYMENTS, &records(&payments)).await;
    let consumer = builder(&db, &server, "orders")
        .await
        .handler(pay_failing_twice_on_seven)
        .retry_policy(RetryPolicy::InPlace)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_settled(&server, STREAM, "orders", PAYMENTS).await;
    running.stop().await;
    assert_eq!(paid_counts(&db.pool).await, vec![1; 30]);
    let handled: Vec<(uuid::Uuid, i32)> =
        sqlx::query_as("SELECT order_id, attempt FROM handled ORDER BY n")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let expected: Vec<(uuid::Uuid, i32)> = payments
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_waits_for_its_stream() {
    let db = TestDb::new().await;
    fixtures::create_orders(&db.pool).await;
    let server = NatsServer::start().await;
    let consumer = builder(&db, &server, "orders")
        .await
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    // No stream yet: the consumer waits (and says so); nothing fails.
    let payments = orders_with_payments(&db.pool, 10).await;
    server.create_stream(STREAM, PAYMENTS, |_| {}).await;
    server.publish(PAYMENTS, &records(&payments)).await;
    wait_settled(&server, STREAM, "orders", PAYMENTS).await;
    assert!(!running.is_finished());
    running.stop().await;
    assert_eq!(paid_counts(&db.pool).await, vec![1; 10]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_without_a_stream_waits_for_one_and_nothing_is_lost() {
    let blocked = outbox_tests::payments::forward_blocked_gauge(Some(format!("{PAYMENTS}.dlq")));
    let db = TestDb::new().await;
    fixtures::create_orders(&db.pool).await;
    let server = NatsServer::start().await;
    server.create_stream(STREAM, PAYMENTS, |_| {}).await;
    let payments = orders_with_payments(&db.pool, 6).await;
    let mut records = records(&payments);
    records.insert(3, not_json());
    server.publish(PAYMENTS, &records).await;
    let consumer = builder(&db, &server, "orders")
        .await
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for(
        "the dead letter blocked",
        Duration::from_secs(30),
        || async { blocked() == Some(1.0) },
    )
    .await;
    // The bad message is held (not terminated) while its dead letter has nowhere to go.
    let durable = format!("orders_{}", PAYMENTS.replace('.', "_"));
    let (_, held) = server.unsettled(STREAM, &durable).await.unwrap();
    assert!(held >= 1, "the bad message is still pending");
    server
        .create_stream(DEAD_LETTERS, &format!("{PAYMENTS}.dlq"), |_| {})
        .await;
    wait_settled(&server, STREAM, "orders", PAYMENTS).await;
    running.stop().await;
    assert_eq!(blocked(), Some(0.0));
    let letters = server.read_stream(DEAD_LETTERS).await;
    assert_eq!(letters.len(), 1);
    assert_dead_letter(&letters[0], "payload is not JSON", "1");
    assert_eq!(paid_counts(&db.pool).await, vec![1; 6]);
}

/// The headers a dead letter must carry, as on Kafka.
fn assert_dead_letter(letter: &outbox_tests::kafka::Received, reason: &str, attempts: &str) {
    assert!(
        letter.header("dlq_error").contains(reason),
        "{} does not say {reason}",
        letter.header("dlq_error")
    );
    assert_eq!(letter.header("dlq_attempts"), attempts);
    assert_eq!(letter.header("dlq_source_topic"), PAYMENTS);
    assert_eq!(letter.header("dlq_source_partition"), "0");
    assert_eq!(letter.header("dlq_source_stream"), STREAM);
    assert!(letter.header("dlq_source_offset").parse::<u64>().unwrap() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_dead_lettered_with_their_reason_and_terminated() {
    let (db, server) = setup().await;
    let payments = orders_with_payments(&db.pool, 6).await;
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
        .handler(fixtures::mark_order_paid)
        .handler(FailsOn(always_failing))
        .max_attempts(3)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_settled(&server, STREAM, "orders", PAYMENTS).await;
    running.stop().await;

    let letters = server.read_stream(DEAD_LETTERS).await;
    assert_eq!(letters.len(), 4, "{letters:?}");
    let of = |event_id: &uuid::Uuid| {
        letters
            .iter()
            .find(|l| l.headers.get("event_id") == Some(&event_id.to_string()))
            .unwrap_or_else(|| panic!("no dead letter of {event_id}"))
    };
    assert_dead_letter(of(&payments[0].0), "negative amount -5", "1");
    assert_dead_letter(of(&payments[1].0), "schema version 9", "1");
    assert_dead_letter(of(&payments[2].0), "the ledger is closed", "3");
    let not_json = letters
        .iter()
        .find(|l| !l.headers.contains_key("event_id"))
        .unwrap();
    assert_dead_letter(not_json, "payload is not JSON", "1");
    // Each keeps its payload and headers.
    assert_eq!(of(&payments[2].0).header("event_type"), "PaymentSucceeded");
    assert_eq!(
        of(&payments[2].0).payload["order_id"],
        serde_json::json!(always_failing)
    );
    // The others took effect once; the dead ones none.
    let paid: Vec<i32> =
        sqlx::query_scalar("SELECT paid FROM orders WHERE id = ANY($1) ORDER BY id")
            .bind(payments.iter().map(|(_, p)| p.order_id).collect::<Vec<_>>())
            .fetch_all(&db.pool)
            .await
            .unwrap();
    // Orders 2 to 5 paid once (order 2's payment too: its other handler's work committed on
    // the first attempt and was deduplicated on the next), orders 0 and 1 never.
    assert_eq!(paid, {
        let mut expected: Vec<(uuid::Uuid, i32)> = payments
            .iter()
            .enumerate()
            .map(|(i, (_, p))| (p.order_id, i32::from(i >= 2)))
            .collect();
        expected.sort();
        expected
            .into_iter()
            .map(|(_, paid)| paid)
            .collect::<Vec<_>>()
    });
}

/// A handler that fails retryably on one order (and records nothing).
struct FailsOn(uuid::Uuid);

impl outbox_runtime::inbox::Handler for FailsOn {
    type Event = PaymentSucceeded;

    fn name(&self) -> &str {
        "fails_on"
    }

    fn handle<'a>(
        &'a self,
        event: PaymentSucceeded,
        _tx: &'a mut sqlx::PgConnection,
        _state: &'a (),
        _meta: &'a outbox_runtime::inbox::MessageMeta<'a>,
    ) -> outbox_runtime::inbox::BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            if event.order_id == self.0 {
                return Err(HandlerError::retryable("the ledger is closed"));
            }
            Ok(())
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_retried_and_the_consumer_goes_on() {
    let (db, server) = setup().await;
    let payments =
        outbox_tests::payments::orders_with_special_payments(&db.pool, 20, |i| i == 3, 13).await;
    server.publish(PAYMENTS, &records(&payments)).await;
    let consumer = builder(&db, &server, "orders")
        .await
        .handler(fixtures::panicky_mark_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_settled(&server, STREAM, "orders", PAYMENTS).await;
    running.stop().await;
    assert_eq!(paid_counts(&db.pool).await, vec![1; 20]);
    assert!(server.read_stream(DEAD_LETTERS).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_mode_stores_acknowledges_and_processes() {
    let (db, server) = setup().await;
    let payments = orders_with_payments(&db.pool, 50).await;
    let mut records = records(&payments);
    records.extend(records.clone()); // each twice
    records.push(not_json());
    server.publish(PAYMENTS, &records).await;
    let consumer = builder(&db, &server, "orders")
        .await
        .handler(fixtures::mark_order_paid)
        .mode(Mode::Inbox)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_settled(&server, STREAM, "orders", PAYMENTS).await;
    let pool = db.pool.clone();
    wait_for("the inbox processed", Duration::from_secs(60), || async {
        count(&pool, "SELECT count(*) FROM inbox_event WHERE processed").await == 50
    })
    .await;
    running.stop().await;
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM inbox_event").await,
        50
    );
    let offsets: Vec<i64> =
        sqlx::query_scalar("SELECT source_offset FROM inbox_event ORDER BY source_offset")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(offsets, (1..=50).collect::<Vec<i64>>(), "stream sequences");
    assert_eq!(paid_counts(&db.pool).await, vec![1; 50]);
    let letters = server.read_stream(DEAD_LETTERS).await;
    assert_eq!(letters.len(), 1);
    assert_dead_letter(&letters[0], "payload is not JSON", "1");
}

/// Sleeps `pause` with `flag` set meanwhile (a test waits for it).
async fn pause_flagged(flag: &std::sync::atomic::AtomicBool, pause: Duration) {
    flag.store(true, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(pause).await;
    flag.store(false, std::sync::atomic::Ordering::SeqCst);
}

/// This test binary's log at `WARN`, for a test that waits for a line of it (a test finds its
/// own group's lines).
fn warnings() -> &'static Log {
    static LOG: std::sync::OnceLock<Log> = std::sync::OnceLock::new();
    LOG.get_or_init(|| Log::install(tracing::Level::WARN))
}

/// [`record_step_held_at_first`] is in its first call.
static HELD: tokio::sync::Notify = tokio::sync::Notify::const_new();
/// Lets [`record_step_held_at_first`]'s first call go on.
static LET_GO: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// [`record_step`], its first call (account 0's first event) held until the test lets it go.
#[outbox_runtime::inbox_handler]
async fn record_step_held_at_first(
    event: Deposited,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    if event.seq == 0 {
        HELD.notify_one();
        LET_GO.notified().await;
    }
    insert_step(tx, &event).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_lease_was_taken_commits_nothing_more_until_it_owns_it_again() {
    let log = warnings();
    let (db, server) = accounts_setup().await;
    let consumer = builder(&db, &server, "fenced")
        .await
        .handler(record_step_held_at_first)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    let records = interleaved(1, 2);
    server.publish(TOPIC, &records[..1]).await;
    tokio::time::timeout(Duration::from_secs(30), HELD.notified())
        .await
        .expect("the first event handled");
    // While its first batch runs (the fence passed), the lease goes to another instance, as
    // when this one stalls past it (an update of no key column: the batch's `FOR KEY SHARE`
    // does not hold it up, as it holds up a takeover).
    let taken = sqlx::query(
        "UPDATE outbox_consumer_lease \
         SET holder = gen_random_uuid(), expires_at = clock_timestamp() + interval '1 hour' \
         WHERE group_id = 'fenced'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(taken.rows_affected(), 1);
    server.publish(TOPIC, &records[1..]).await;
    LET_GO.notify_one();
    // The batch that checked the lease before it was taken commits; the next one is refused.
    wait_for(
        "the next batch refused",
        Duration::from_secs(30),
        || async {
            log.text().lines().any(|line| {
                line.contains("another instance owns the lease") && line.contains("\"fenced\"")
            })
        },
    )
    .await;
    assert_eq!(steps(&db.pool).await["acct-0"], vec![0]);
    // The other instance gives it up: this one takes it again, and goes on in order.
    sqlx::query(
        "UPDATE outbox_consumer_lease SET holder = NULL, expires_at = clock_timestamp() \
         WHERE group_id = 'fenced'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    wait_settled(&server, "ACCOUNTS", "fenced", TOPIC).await;
    running.stop().await;
    assert_eq!(steps(&db.pool).await["acct-0"], vec![0, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_killed_mid_consumption_loses_nothing_and_repeats_nothing() {
    let (db, mut server) = setup().await;
    let payments = orders_with_payments(&db.pool, 400).await;
    server.publish(PAYMENTS, &records(&payments)).await;
    let consumer = builder(&db, &server, "orders")
        .await
        .handler(fixtures::mark_order_paid)
        .batch_size(20)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    let pool = db.pool.clone();
    for round in 1..=2 {
        let at_least = 100 * round;
        wait_for("some payments handled", Duration::from_secs(60), || async {
            count(&pool, "SELECT count(*) FROM orders WHERE paid > 0").await >= at_least
        })
        .await;
        server.kill(); // acknowledgements on their way are lost
        server.spawn().await;
    }
    wait_settled(&server, STREAM, "orders", PAYMENTS).await;
    running.stop().await;
    assert_eq!(paid_counts(&db.pool).await, vec![1; 400]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_stream_replayed_is_handled_once() {
    let (db, server) = accounts_setup().await;
    let relay = Relay::builder(db.pool.clone())
        .jetstream(JetStream::new(server.client().await))
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let relaying = Running::relay(&relay);
    let n = emit_events(&db.pool, 10, 10, 50).await;
    wait_until_published(&db.pool, Duration::from_secs(60)).await;
    relaying.stop().await;
    let consumer = builder(&db, &server, "ledger")
        .await
        .handler(record_step)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_settled(&server, "ACCOUNTS", "ledger", TOPIC).await;
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM steps").await,
        n as i64
    );

    // The broker loses the stream's messages; the database, the source of truth, has them.
    let js = server.jetstream().await;
    js.get_stream("ACCOUNTS")
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    let replay = Replay::jetstream(db.pool.clone(), JetStream::new(server.client().await)).unwrap();
    let replayed = replay
        .run(&ReplayFilter::topic(TOPIC), None, |_| {})
        .await
        .unwrap();
    assert_eq!(replayed.published as usize, n);
    let held = server
        .read_stream_when("ACCOUNTS", n as u64, Duration::from_secs(30))
        .await;
    assert_eq!(held.len(), n, "the stream holds the replay");
    wait_settled(&server, "ACCOUNTS", "ledger", TOPIC).await;
    running.stop().await;
    // Every replayed event was a duplicate: handled once, before the loss.
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM steps").await,
        n as i64
    );
    for (account, seqs) in steps(&db.pool).await {
        assert_eq!(seqs, (0..10).collect::<Vec<i64>>(), "account {account}");
    }
}

/// Set while [`mark_order_paid_slowly`] pauses.
static PAUSING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Marks the order paid, a few milliseconds after it is called (a handler with work to do);
/// over a payment of 4,242 it first pauses 5 s (two and a half times the tests' `ack_wait` of
/// 2 s).
#[outbox_runtime::inbox_handler]
async fn mark_order_paid_slowly(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    if event.amount == 4_242 {
        pause_flagged(&PAUSING, Duration::from_secs(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(3)).await;
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_consumer_finishes_the_batch_in_hand_and_no_more_of_its_backlog() {
    // While a batch is handled the next one is read; a consumer told to stop must still stop
    // after the batch in hand, not go on while there is a backlog to read ahead.
    let (db, server) = setup().await;
    let payments = orders_with_payments(&db.pool, 3_000).await;
    server.publish(PAYMENTS, &records(&payments)).await;
    let consumer = builder(&db, &server, "orders")
        .await
        .handler(mark_order_paid_slowly)
        .batch_size(50)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    let paid = || count(&db.pool, "SELECT count(*) FROM orders WHERE paid > 0");
    wait_for("a few batches handled", Duration::from_secs(60), || async {
        paid().await >= 100
    })
    .await;
    running.stop().await;
    let at_stop = paid().await;
    // The batch in hand when it was told to stop, and the one that may have begun meanwhile.
    assert!(
        at_stop < 300,
        "{at_stop} of 3,000 events handled after the stop was asked for at 100 or more"
    );
    // What it had read ahead was not settled: a consumer of the group gets it, once each.
    let consumer = builder(&db, &server, "orders")
        .await
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_settled(&server, STREAM, "orders", PAYMENTS).await;
    running.stop().await;
    assert_eq!(paid_counts(&db.pool).await, vec![1; 3_000]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_read_ahead_during_a_long_batch_is_not_delivered_again() {
    // Messages read while a batch is handled wait for it; the server must be told they are
    // being worked on, as the batch's own are, or it delivers them again after `ack_wait`:
    // copies that come back behind later messages of their key.
    let (db, server) = setup().await;
    let payments =
        outbox_tests::payments::orders_with_special_payments(&db.pool, 36, |i| i == 0, 4_242).await;
    let records = records(&payments);
    let consumer = builder(&db, &server, "orders")
        .await
        .handler(mark_order_paid_slowly)
        .batch_size(10)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    // The slow one alone is the first batch; the 35 others (three and a half batches, within
    // the four the server may have out at once) come while it is handled.
    server.publish(PAYMENTS, &records[..1]).await;
    wait_for("the long batch begun", Duration::from_secs(30), || async {
        PAUSING.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await;
    server.publish(PAYMENTS, &records[1..]).await;
    // While the pause lasts (past `ack_wait` for the 35), the server must not have delivered
    // any of them again (it counts the messages delivered again and not yet settled).
    let js = server.jetstream().await;
    let durable = format!("orders_{}", PAYMENTS.replace('.', "_"));
    let mut redelivered = 0;
    while PAUSING.load(std::sync::atomic::Ordering::SeqCst) {
        let stream = js.get_stream(STREAM).await.unwrap();
        let info = stream.consumer_info(&durable).await.unwrap();
        redelivered = redelivered.max(info.num_redelivered);
        tokio::time::sleep(Duration::from_millis(50)).await; // the pause's pace, not a wait
    }
    wait_settled(&server, STREAM, "orders", PAYMENTS).await;
    running.stop().await;
    assert_eq!(paid_counts(&db.pool).await, vec![1; 36]);
    assert_eq!(
        redelivered, 0,
        "messages delivered again while they waited for the batch before them"
    );
}

/// JetStream delivers again what a consumer did not acknowledge in time in the order the waits
/// ran out, so a message delivered again and left unacknowledged once more comes back behind
/// the others. Sessions ending one after another (a consumer gone holding a key's events 0..6,
/// then one holding event 0, then one holding event 1) leave the server delivering 2, 3, 4, 5,
/// 0, 1. The consumer still handles the key's events in order, two at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_delivered_again_twice_are_handled_in_the_streams_order() {
    let (db, server) = accounts_setup().await;
    let consumer = || async {
        builder(&db, &server, "ledger")
            .await
            .handler(record_step)
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
    let pool = db.pool.clone();
    wait_settled(&server, "ACCOUNTS", "ledger", TOPIC).await;
    running.stop().await;
    assert_eq!(count(&pool, "SELECT count(*) FROM steps").await, 6);
    assert_eq!(
        steps(&db.pool).await["acct-0"],
        (0..6).collect::<Vec<i64>>()
    );
}
