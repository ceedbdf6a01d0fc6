//! Consumers from RabbitMQ on PostgreSQL, against the machine's node (each test in a vhost of
//! its own): what is not yet run on MariaDB too. The inbox mode, shard queues read two batches
//! at a time, a consumer waiting for its queues, names over AMQP's limit, and messages
//! returned twice in either mode. The dedup contract both databases share (effects once in
//! each key's order, the delay queues, dead letters, panics, stopping, two instances handing
//! over) is `rabbitmq_contract.rs`.
//! (Killed consumers and brokers: `consumer_rabbitmq_faults.rs`.)

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_runtime::inbox::{Consumer, ConsumerBuilder, HandlerError, Mode};
use outbox_runtime::relay::RabbitMq;
use outbox_tests::deposits::{
    create_steps, interleaved, record_step, record_step_and_attempt, steps,
    ATTEMPTS as STEP_ATTEMPTS, TOPIC,
};
use outbox_tests::fixtures::{self, PAYMENTS};
use outbox_tests::kafka::{Outgoing, Received};
use outbox_tests::payments::{not_json, orders_with_payments, paid_counts, records, wait_for};
use outbox_tests::rabbitmq::{self as mq, dead_letters, Vhost};
use outbox_tests::{count, Running, TestDb};

/// Shards of every topic here.
const SHARDS: u16 = 4;

fn rabbit(url: &str) -> RabbitMq {
    RabbitMq::new(url)
        .shards(SHARDS)
        .heartbeat(Duration::from_secs(2))
}

/// A consumer of group `group` reading `url`, quick to retry.
fn builder(db: &TestDb, url: &str, group: &str) -> ConsumerBuilder {
    Consumer::builder(db.pool.clone())
        .rabbitmq(rabbit(url))
        .group_id(group)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
}

/// Whether every queue of `topic`'s group `group` is settled.
fn settled(vhost: &Vhost, topic: &str, group: &str) -> bool {
    mq::settled(vhost, topic, group, SHARDS)
}

/// The headers a dead letter of group `orders` must carry.
fn assert_dead_letter(letter: &Received, reason: &str, attempts: &str) {
    mq::assert_dead_letter(letter, reason, attempts, SHARDS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_mode_stores_acknowledges_and_processes() {
    let vhost = Vhost::new("rc-inbox");
    let url = vhost.url();
    let db = TestDb::new().await;
    fixtures::create_orders(&db.pool).await;
    rabbit(&url)
        .ensure_topology(PAYMENTS, "orders")
        .await
        .unwrap();
    let payments = orders_with_payments(&db.pool, 50).await;
    let mut records = records(&payments);
    records.extend(records.clone()); // each twice
    records.push(not_json());
    mq::publish_sharded(&url, PAYMENTS, SHARDS, &records).await;
    let consumer = builder(&db, &url, "orders")
        .handler(fixtures::mark_order_paid)
        .mode(Mode::Inbox)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    let pool = db.pool.clone();
    wait_for("the inbox processed", Duration::from_secs(60), || async {
        count(&pool, "SELECT count(*) FROM inbox_event WHERE processed").await == 50
            && settled(&vhost, PAYMENTS, "orders")
    })
    .await;
    running.stop().await;
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM inbox_event").await,
        50
    );
    assert_eq!(paid_counts(&db.pool).await, vec![1; 50]);
    let letters = dead_letters(&url, PAYMENTS, 1).await;
    assert_dead_letter(&letters[0], "payload is not JSON", "1");
}

/// For each shard queue of `group`: the prefetch of each of its consumers.
fn shard_prefetches(vhost: &Vhost, topic: &str, group: &str) -> BTreeMap<String, Vec<u32>> {
    let mut by_queue: BTreeMap<String, Vec<u32>> = (0..SHARDS)
        .map(|shard| (format!("{topic}.{group}.{shard}"), Vec::new()))
        .collect();
    let out = mq::rabbitmqctl(
        None,
        &[
            "list_consumers",
            "-p",
            &vhost.name,
            "-q",
            "--no-table-headers",
            "queue_name",
            "prefetch_count",
        ],
    );
    for line in out.lines() {
        let Some((queue, prefetch)) = line.split_once('\t') else {
            continue;
        };
        if let (Some(all), Ok(prefetch)) = (by_queue.get_mut(queue), prefetch.trim().parse()) {
            all.push(prefetch);
        }
    }
    by_queue
}

/// A session reads one message at a time until one comes that no consumer held before, then
/// two batches at a time. RabbitMQ applies a prefetch to the consumers subscribed after it is
/// set: the careful consumer is replaced by a wide one (this failed when the prefetch was only
/// set again on the channel: every shard stayed at 1, a message per round trip).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_fresh_message_each_shard_is_read_two_batches_at_a_time() {
    let vhost = Vhost::new("rc-prefetch");
    let url = vhost.url();
    let db = TestDb::new().await;
    create_steps(&db.pool).await;
    let consumer = builder(&db, &url, "ledger")
        .handler(record_step)
        .batch_size(25)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for(
        "one careful consumer (prefetch 1) on each shard queue",
        Duration::from_secs(30),
        || async {
            shard_prefetches(&vhost, TOPIC, "ledger")
                .values()
                .all(|p| *p == vec![1])
        },
    )
    .await;
    // 40 accounts, 2 events each: every shard gets some.
    let records = interleaved(40, 2);
    mq::publish_sharded(&url, TOPIC, SHARDS, &records).await;
    let pool = db.pool.clone();
    wait_for("all 80 handled", Duration::from_secs(60), || async {
        count(&pool, "SELECT count(*) FROM steps").await == 80
    })
    .await;
    wait_for(
        "one consumer on each shard queue, its prefetch two batches",
        Duration::from_secs(30),
        || async {
            shard_prefetches(&vhost, TOPIC, "ledger")
                .values()
                .all(|p| *p == vec![50])
        },
    )
    .await;
    wait_for("all settled", Duration::from_secs(30), || async {
        settled(&vhost, TOPIC, "ledger")
    })
    .await;
    running.stop().await;
    assert_eq!(steps(&db.pool).await.len(), 40);
}

/// A topic of this test's own (the missing-topic gauge is labelled by topic, and the other
/// tests of this binary consume theirs meanwhile).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, outbox_runtime::OutboxEvent)]
#[outbox(
    topic = "parcel.events",
    aggregate_type = "Parcel",
    event_type = "Shipped"
)]
struct Shipped {
    #[outbox(aggregate_id)]
    parcel: String,
}

#[outbox_runtime::inbox_handler]
async fn record_shipped(event: Shipped, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO shipped (parcel) VALUES ($1)")
        .bind(&event.parcel)
        .execute(tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_waits_for_missing_queues_and_says_so() {
    let missing = || mq::gauge("outbox_consumer_missing_topic", "topic", "parcel.events");
    let _ = missing(); // the recorder installed before the consumer starts
    let vhost = Vhost::new("rc-missing");
    let url = vhost.url();
    let db = TestDb::new().await;
    sqlx::query("CREATE TABLE shipped (parcel text PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let consumer = Consumer::builder(db.pool.clone())
        .rabbitmq(rabbit(&url).declare_topology(false))
        .group_id("depot")
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
        .handler(record_shipped)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for(
        "the missing topic shown",
        Duration::from_secs(30),
        || async { missing() == Some(1.0) },
    )
    .await;
    assert!(
        mq::list_queues(None, &vhost.name).is_empty(),
        "nothing declared"
    );
    let report = rabbit(&url)
        .ensure_topology("parcel.events", "depot")
        .await
        .unwrap();
    assert!(
        report.iter().all(|(_, depth)| depth.is_some()),
        "{report:?}"
    );
    let records: Vec<Outgoing> = (0..20)
        .map(|i| {
            let event = Shipped {
                parcel: format!("p{i}"),
            };
            Outgoing::event(&event, uuid::Uuid::now_v7())
        })
        .collect();
    mq::publish_sharded(&url, "parcel.events", SHARDS, &records).await;
    let pool = db.pool.clone();
    wait_for("all 20 handled", Duration::from_secs(60), || async {
        count(&pool, "SELECT count(*) FROM shipped").await == 20
            && settled(&vhost, "parcel.events", "depot")
    })
    .await;
    assert_eq!(missing(), Some(0.0));
    // A queue deleted under the consumer (the node cancels its subscription): missing again,
    // waited for, consumed once declared again.
    let shard = mq::shard_of("p0", SHARDS);
    mq::delete_queue(&url, &format!("parcel.events.depot.{shard}")).await;
    wait_for(
        "the deleted queue shown",
        Duration::from_secs(30),
        || async { missing() == Some(1.0) },
    )
    .await;
    rabbit(&url)
        .ensure_topology("parcel.events", "depot")
        .await
        .unwrap();
    let again = Outgoing::event(
        &Shipped {
            parcel: "p0-again".into(),
        },
        uuid::Uuid::now_v7(),
    );
    let again = Outgoing {
        key: "p0".into(),
        ..again
    };
    mq::publish(&url, "parcel.events", &shard.to_string(), &[again]).await;
    wait_for("the one after handled", Duration::from_secs(60), || async {
        count(&pool, "SELECT count(*) FROM shipped").await == 21
            && settled(&vhost, "parcel.events", "depot")
    })
    .await;
    assert_eq!(missing(), Some(0.0));
    assert!(!running.is_finished());
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_over_amqps_255_bytes_stop_the_consumer_with_what_to_shorten() {
    let db = TestDb::new().await;
    let consumer = builder(&db, mq::SHARED_URL, &"g".repeat(240))
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let ran = tokio::time::timeout(
        Duration::from_secs(10),
        consumer.run(tokio_util::sync::CancellationToken::new()),
    )
    .await
    .expect("refused at once, not retried");
    match ran {
        Err(outbox_runtime::Error::Config(e)) => {
            assert!(e.contains("over AMQP's 255") && e.contains(PAYMENTS), "{e}")
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

/// A quorum queue puts a message returned a second time behind what was returned before it
/// (see `relayed_then_returned_out_of_order`); the consumer still handles the key's events in
/// order, in either mode: 0..6; then 6..11 returned in order after events handled in an earlier
/// session, none sent back; then 11..17 out of order again, the predecessor of 11 gone from the
/// database (as retention deletes it), so that 11 goes back once for nothing. (On MariaDB:
/// `consumer_mysql.rs`.)
async fn a_message_returned_twice_is_handled_in_its_keys_order(mode: Mode) {
    let vhost = Vhost::new("rc-returned");
    let db = TestDb::new().await;
    create_steps(&db.pool).await;
    // One relay publishes all: each message names its key's previous one.
    let relay = mq::relay_to(&db.pool, &vhost, SHARDS);
    mq::relayed_then_returned_out_of_order(&db.pool, &relay, &vhost, SHARDS, 0).await;
    handle_steps_until(&db, &vhost, mode, 6).await;
    assert_eq!(
        steps(&db.pool).await["acct-1"],
        (0..6).collect::<Vec<i64>>()
    );
    let once = mq::relayed_then_returned_once(&db.pool, &relay, &vhost, SHARDS).await;
    handle_steps_until(&db, &vhost, mode, 11).await;
    assert_eq!(
        steps(&db.pool).await["acct-1"],
        (0..11).collect::<Vec<i64>>()
    );
    let table = match mode {
        Mode::Dedup => "processed_event",
        Mode::Inbox => "inbox_event",
    };
    sqlx::query(&format!("DELETE FROM {table} WHERE event_id = $1"))
        .bind(once[4])
        .execute(&db.pool)
        .await
        .unwrap();
    let twice = mq::relayed_then_returned_out_of_order(&db.pool, &relay, &vhost, SHARDS, 11).await;
    handle_steps_until(&db, &vhost, mode, 17).await;
    assert_eq!(
        steps(&db.pool).await["acct-1"],
        (0..17).collect::<Vec<i64>>()
    );
    // In dedup mode a handler's attempt counts the times the message came back unsettled (not
    // the times it was sent back to wait); in inbox mode the row's attempts count.
    let handled_at = STEP_ATTEMPTS.lock().unwrap();
    let at = |ids: &[uuid::Uuid]| ids.iter().map(|id| handled_at[id]).collect::<Vec<u32>>();
    if mode == Mode::Dedup {
        assert_eq!(at(&once), [2; 5]);
        assert_eq!(at(&twice), [3, 3, 2, 2, 2, 2]);
    } else {
        assert_eq!(at(&once), [1; 5]);
    }
}

/// Runs a consumer of group `ledger` in `mode` until `n` steps are recorded and its queues are
/// settled.
async fn handle_steps_until(db: &TestDb, vhost: &Vhost, mode: Mode, n: i64) {
    let consumer = builder(db, &vhost.url(), "ledger")
        .handler(record_step_and_attempt)
        .mode(mode)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for("the steps handled", Duration::from_secs(60), || async {
        count(&db.pool, "SELECT count(*) FROM steps").await >= n && settled(vhost, TOPIC, "ledger")
    })
    .await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_a_message_returned_twice_is_handled_in_its_keys_order() {
    a_message_returned_twice_is_handled_in_its_keys_order(Mode::Dedup).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_a_message_returned_twice_is_handled_in_its_keys_order() {
    a_message_returned_twice_is_handled_in_its_keys_order(Mode::Inbox).await;
}
