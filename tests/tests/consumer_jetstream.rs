//! Consumers from NATS JetStream on PostgreSQL, against real `nats-server` processes (one per
//! test): settings refused, dead letters waiting for their stream, the inbox mode, a lease
//! taken over under a running batch (MariaDB's own in `consumer_mysql_jetstream.rs`), the
//! server killed mid-consumption (on MariaDB: `consumer_mysql_faults.rs`), and the broker-loss
//! drill (the stream purged, `replay` restores it, nothing is done twice). The dedup contract
//! both databases share (effects once, retries, dead letters, panics, stopping, read-ahead, a
//! consumer waiting for its stream) is `jetstream_contract.rs`; per-key order with several
//! consumers, crashes and handovers are `jetstream_lease.rs`'s.

use std::time::Duration;

use outbox_runtime::admin::{Replay, ReplayFilter};
use outbox_runtime::inbox::{Consumer, ConsumerBuilder, HandlerError, Mode};
use outbox_runtime::relay::{JetStream, Relay};
use outbox_tests::deposits::{
    create_steps, emit_events, insert_step, interleaved, record_step, steps, wait_until_published,
    Deposited, TOPIC,
};
use outbox_tests::fixtures::{self, PAYMENTS};
use outbox_tests::log::Log;
use outbox_tests::nats::{assert_dead_letter, NatsServer};
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
    assert_dead_letter(&letters[0], STREAM, "payload is not JSON", "1");
    assert_eq!(paid_counts(&db.pool).await, vec![1; 6]);
}

/// The headers a dead letter must carry, as on Kafka.
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
    assert_dead_letter(&letters[0], STREAM, "payload is not JSON", "1");
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
