//! Consumers on MariaDB (the machine's 10.11; MySQL 8 cannot be had here), dedup mode, on the
//! mock cluster and RabbitMQ, what is MariaDB's own: a handler whose transaction the server
//! rolled back (as after a deadlock it caught), two consumers racing on the same pairs, a
//! handler that emits or commits on its own, a missing dead-letter topic recorded, and what
//! `build` refuses; and a message RabbitMQ returned twice (PostgreSQL's in
//! `consumer_rabbitmq.rs`). The contract both databases share (effects once, dead letters, retries,
//! panics) is `consumer_contract.rs` on Kafka, `jetstream_contract.rs` and
//! `rabbitmq_contract.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use outbox_runtime::inbox::{Consumer, HandlerError, Mode};
use outbox_runtime::inbox_handler;
use outbox_runtime::relay::RabbitMq;
use outbox_tests::deposits::ATTEMPTS;
use outbox_tests::fixtures::{PaymentSucceeded, PAYMENTS};
use outbox_tests::kafka::{committed_total, produce, Kafka};
use outbox_tests::mysql::{
    count, create_steps, payments_setup, record_step_and_attempt, steps, MySqlTestDb,
};
use outbox_tests::payments::{
    dead_letters, no_auto_created_topics, produce_in_one_partition, records, retried, wait_for,
    PARTITIONS,
};
use outbox_tests::rabbitmq as mq;
use outbox_tests::Running;
use rdkafka::ClientConfig;
use sqlx::{Executor, MySqlConnection, MySqlPool};
use uuid::Uuid;

/// `n` orders, each with its payment event (and the event's id).
async fn orders_with_payments(pool: &MySqlPool, n: usize) -> Vec<(Uuid, PaymentSucceeded)> {
    let mut payments = Vec::new();
    for _ in 0..n {
        let order_id = Uuid::now_v7();
        sqlx::query("INSERT INTO orders (id) VALUES (?)")
            .bind(order_id)
            .execute(pool)
            .await
            .unwrap();
        let event = PaymentSucceeded {
            payment_id: Uuid::now_v7(),
            order_id,
            amount: 100,
        };
        payments.push((Uuid::now_v7(), event));
    }
    payments
}

/// `paid` of every order, in the order of `payments`.
async fn paid(pool: &MySqlPool, payments: &[(Uuid, PaymentSucceeded)]) -> Vec<i32> {
    let mut counts = Vec::new();
    for (_, p) in payments {
        let paid: i32 = sqlx::query_scalar("SELECT paid FROM orders WHERE id = ?")
            .bind(p.order_id)
            .fetch_one(pool)
            .await
            .unwrap();
        counts.push(paid);
    }
    counts
}

fn consumer(
    db: &MySqlTestDb,
    kafka: &Kafka,
) -> outbox_runtime::inbox::ConsumerBuilder<(), sqlx::MySql> {
    let mut config = ClientConfig::new();
    config.set("auto.commit.interval.ms", "100");
    Consumer::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .group_id("orders")
        .consumer_config(config)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
}

async fn all_committed(kafka: &Kafka, total: i64) {
    wait_for(
        "every message consumed and committed",
        Duration::from_secs(60),
        || async { committed_total(&kafka.bootstrap(), "orders", PAYMENTS, PARTITIONS) == total },
    )
    .await;
}

#[inbox_handler]
async fn mark_paid(event: PaymentSucceeded, tx: &mut MySqlConnection) -> Result<(), HandlerError> {
    if event.amount < 0 {
        return Err(HandlerError::permanent(format!(
            "negative amount {}",
            event.amount
        )));
    }
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = ?")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    Ok(())
}

/// Calls of [`rolls_back_once`].
static ROLLBACK_CALLS: AtomicUsize = AtomicUsize::new(0);

/// Pays, then, the first two times, ends the transaction under the framework as InnoDB does on
/// a deadlock (a `ROLLBACK` the handler does not report), pays once more, as a handler that
/// caught a deadlock would go on, and returns `Ok`.
#[inbox_handler]
async fn rolls_back_once(
    event: PaymentSucceeded,
    tx: &mut MySqlConnection,
) -> Result<(), HandlerError> {
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = ?")
        .bind(event.order_id)
        .execute(&mut *tx)
        .await?;
    if event.amount == 7 && ROLLBACK_CALLS.fetch_add(1, Ordering::SeqCst) < 2 {
        tx.execute(sqlx::raw_sql("ROLLBACK")).await?;
        sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = ?")
            .bind(event.order_id)
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// A batch whose transaction the server rolled back under a handler that returned `Ok` is not
/// committed as if whole: its straight pass finds the batch's savepoint gone at the commit, the
/// pass with a savepoint per handler finds the handler (its savepoint gone when released), the
/// batch is done again without it, and its message fails and is retried. What the handler (and
/// those after it) wrote after the rollback never commits: the batch runs with autocommit off.
/// Fails on a consumer that does not check its transaction: the batch-mates before it stay
/// unpaid, their offsets stored; and on one with autocommit on: the culprit is paid 3 times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_rolled_back_under_a_handler_is_found_and_its_batch_done_again() {
    let (db, kafka) = payments_setup().await;
    let mut payments = orders_with_payments(&db.pool, 30).await;
    payments[10].1.amount = 7;
    let all = produce_in_one_partition(&kafka, &payments).await;
    let consumer = consumer(&db, &kafka)
        .handler(rolls_back_once)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    all_committed(&kafka, all.len() as i64).await;
    wait_for(
        "the culprit's retry handled",
        Duration::from_secs(30),
        || async { count(&db.pool, "SELECT COUNT(*) FROM processed_event").await == 30 },
    )
    .await;
    running.stop().await;
    assert_eq!(paid(&db.pool, &payments).await, vec![1; 30]);
    let retry = retried(&kafka, 1).await;
    assert_eq!(retry.len(), 1, "the culprit retried once");
    assert!(
        retry[0]
            .header("outbox_retry_error")
            .contains("returned, but its transaction had ended under it"),
        "{}",
        retry[0].header("outbox_retry_error")
    );
}

/// Named with a trailing space, which MariaDB's comparison of keys ignores.
#[inbox_handler(name = "padded ")]
async fn padded(event: PaymentSucceeded, tx: &mut MySqlConnection) -> Result<(), HandlerError> {
    let _ = (event, tx);
    Ok(())
}

#[tokio::test]
async fn build_refuses_what_is_not_built_on_mysql_yet() {
    let db = MySqlTestDb::new().await;
    let kafka = Kafka::mock();
    let refused = |b: outbox_runtime::inbox::ConsumerBuilder<(), sqlx::MySql>| {
        b.build().unwrap_err().to_string()
    };
    let inbox = refused(consumer(&db, &kafka).handler(mark_paid).mode(Mode::Inbox));
    assert!(
        inbox.contains("inbox mode is not built on MariaDB/MySQL yet"),
        "{inbox}"
    );
    let spaced = refused(consumer(&db, &kafka).handler(padded));
    assert!(spaced.contains("ends with a space"), "{spaced}");
    let long = refused(
        consumer(&db, &kafka)
            .group_id("g".repeat(250))
            .handler(mark_paid),
    );
    assert!(
        long.contains("longer than `processed_event.handler` holds"),
        "{long}"
    );
}

/// A quorum queue puts a message returned a second time behind what was returned before it
/// (see `relayed_then_returned_out_of_order`); the consumer on MariaDB still handles the key's
/// events in order, and handles at once what comes back after events handled before, as on
/// PostgreSQL (`consumer_rabbitmq.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_returned_twice_by_rabbitmq_is_handled_in_its_keys_order() {
    const SHARDS: u16 = 4;
    let vhost = mq::Vhost::new("rc-mysql-returned");
    let db = MySqlTestDb::new().await;
    create_steps(&db.pool).await;
    let handle_until = |n: i64| {
        let consumer = Consumer::builder(db.pool.clone())
            .rabbitmq(RabbitMq::new(vhost.url()).shards(SHARDS))
            .group_id("ledger")
            .handler(record_step_and_attempt)
            .build()
            .unwrap();
        let pool = db.pool.clone();
        async move {
            let running = Running::consumer(&consumer);
            wait_for("the steps handled", Duration::from_secs(60), || async {
                count(&pool, "SELECT COUNT(*) FROM processed_event").await == n
            })
            .await;
            running.stop().await;
        }
    };
    // One relay publishes all: each message names its key's previous one.
    let relay = mq::relay_to(&db.pool, &vhost, SHARDS);
    mq::relayed_then_returned_out_of_order(&db.pool, &relay, &vhost, SHARDS, 0).await;
    handle_until(6).await;
    assert_eq!(
        steps(&db.pool).await["acct-1"],
        (0..6).collect::<Vec<i64>>()
    );
    let held = mq::relayed_then_returned_once(&db.pool, &relay, &vhost, SHARDS).await;
    handle_until(11).await;
    assert_eq!(
        steps(&db.pool).await["acct-1"],
        (0..11).collect::<Vec<i64>>()
    );
    let attempts = ATTEMPTS.lock().unwrap();
    let attempts: Vec<u32> = held.iter().map(|id| attempts[id]).collect();
    assert_eq!(attempts, [2; 5]);
}

/// Pays; its dedup key is the name as it stands, whatever the group.
#[inbox_handler(name = "shared-payments")]
async fn pay_shared(event: PaymentSucceeded, tx: &mut MySqlConnection) -> Result<(), HandlerError> {
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = ?")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    Ok(())
}

/// Two consumers (two groups, so each reads every message) whose handler shares one dedup key
/// handle the same messages at the same time: their batches insert the same pairs at once, one
/// waits for the other's transaction, and each effect happens once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_racing_on_the_same_pairs_apply_each_once() {
    let (db, kafka) = payments_setup().await;
    let payments = orders_with_payments(&db.pool, 300).await;
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
    let running: Vec<Running> = ["a", "b"]
        .into_iter()
        .map(|group| {
            let consumer = consumer(&db, &kafka)
                .group_id(group)
                .handler(pay_shared)
                .build()
                .unwrap();
            Running::consumer(&consumer)
        })
        .collect();
    for group in ["a", "b"] {
        wait_for(
            "both groups consumed everything",
            Duration::from_secs(60),
            || async { committed_total(&kafka.bootstrap(), group, PAYMENTS, PARTITIONS) == 300 },
        )
        .await;
    }
    Running::stop_all(running).await;
    assert_eq!(paid(&db.pool, &payments).await, vec![1; 300]);
    assert_eq!(
        count(&db.pool, "SELECT COUNT(*) FROM processed_event").await,
        300
    );
}

/// A consumer whose dead-letter topic is missing records it in MariaDB, and `mysql::health`
/// (`outbox status --check`) warns of it, naming the group and the topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_topic_is_recorded_and_warned_of() {
    let db = MySqlTestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(PAYMENTS, PARTITIONS).await;
    kafka
        .create_topic(&format!("{PAYMENTS}.retry"), PARTITIONS)
        .await;
    // A record the group left behind when it had two retry tiers: it wants that topic no more.
    sqlx::query(
        "INSERT INTO outbox_consumer_missing_topic (group_id, topic, source_topic, role, seen_at) \
         VALUES ('orders', 'payment.events.retry-2', 'payment.events', 'retry', UTC_TIMESTAMP())",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let consumer = consumer(&db, &kafka)
        .producer_config(no_auto_created_topics())
        .handler(mark_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    let dlq = format!("{PAYMENTS}.dlq");
    let thresholds = outbox_runtime::admin::HealthThresholds::default();
    wait_for(
        "the missing topic warned of",
        Duration::from_secs(30),
        || async {
            let health = outbox_runtime::mysql::health(&db.pool, &thresholds)
                .await
                .unwrap();
            health.warnings.iter().any(|w| {
                let text = w.to_string();
                text.contains(&dlq) && text.contains("orders")
            })
        },
    )
    .await;
    running.stop().await;
    let recorded: Vec<(String, String)> = sqlx::query_as(
        "SELECT CAST(topic AS CHAR), CAST(role AS CHAR) FROM outbox_consumer_missing_topic",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        recorded,
        [(dlq, "dead_letter".to_owned())],
        "the stale row replaced"
    );
}

#[derive(serde::Serialize, outbox_runtime::OutboxEvent)]
#[outbox(topic = "shipping.events", aggregate_type = "Order")]
struct ShipmentRequested {
    #[outbox(aggregate_id)]
    order_id: Uuid,
}

/// Pays and emits the next step of the order into the outbox, in the batch's transaction.
#[inbox_handler]
async fn pay_and_ship(
    event: PaymentSucceeded,
    tx: &mut MySqlConnection,
) -> Result<(), HandlerError> {
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = ?")
        .bind(event.order_id)
        .execute(&mut *tx)
        .await?;
    outbox_runtime::mysql::emit(
        tx,
        &ShipmentRequested {
            order_id: event.order_id,
        },
    )
    .await?;
    Ok(())
}

/// A handler emits events with `mysql::emit` in its batch's transaction (the batch runs with
/// autocommit off, which an emit elsewhere refuses), once per event over duplicates; and every
/// connection the consumer gives back to the pool has its session as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_emits_in_the_batch_and_the_pool_gets_its_sessions_back() {
    let (db, kafka) = payments_setup().await;
    let payments = orders_with_payments(&db.pool, 50).await;
    let mut twice = records(&payments);
    twice.extend(records(&payments));
    produce(&kafka.bootstrap(), PAYMENTS, &twice).await;
    let consumer = consumer(&db, &kafka).handler(pay_and_ship).build().unwrap();
    let running = Running::consumer(&consumer);
    all_committed(&kafka, 100).await;
    running.stop().await;
    assert_eq!(paid(&db.pool, &payments).await, vec![1; 50]);
    assert_eq!(
        count(
            &db.pool,
            "SELECT COUNT(*) FROM outbox_event WHERE topic = 'shipping.events'"
        )
        .await,
        50
    );
    // Every connection of the pool at once.
    let mut held = Vec::new();
    for _ in 0..db.pool.options().get_max_connections() {
        let mut conn = db.pool.acquire().await.unwrap();
        let session: (i64, Option<i64>) =
            sqlx::query_as("SELECT @@autocommit, CAST(@outbox_consumer_batch AS SIGNED)")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        assert_eq!(session, (1, None));
        held.push(conn);
    }
}

/// Calls of [`rolls_back_then_checked`]'s rollback.
static FIRST_ROLLBACK: AtomicUsize = AtomicUsize::new(0);

/// Pays. The message of amount 7 ends the transaction under the framework the first time (a
/// swallowed deadlock) and returns `Ok`; the message of amount 8 checks that the order named by
/// its `payment_id` (the other's) is paid, and fails for good if not.
#[inbox_handler]
async fn rolls_back_then_checked(
    event: PaymentSucceeded,
    tx: &mut MySqlConnection,
) -> Result<(), HandlerError> {
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = ?")
        .bind(event.order_id)
        .execute(&mut *tx)
        .await?;
    if event.amount == 7 && FIRST_ROLLBACK.fetch_add(1, Ordering::SeqCst) == 0 {
        tx.execute(sqlx::raw_sql("ROLLBACK")).await?;
    }
    if event.amount == 8 {
        let paid: i32 = sqlx::query_scalar("SELECT paid FROM orders WHERE id = ?")
            .bind(event.payment_id)
            .fetch_one(&mut *tx)
            .await?;
        if paid == 0 {
            return Err(HandlerError::permanent("the order it follows is not paid"));
        }
    }
    Ok(())
}

/// A handler that fails because the server rolled the transaction back under another (whose
/// work it needed) is not blamed: the batch is done again, each once. Fails when the failure
/// seen after such a rollback is taken for the handler's own: its message is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_caused_by_a_rollback_under_another_handler_is_not_blamed() {
    let (db, kafka) = payments_setup().await;
    let mut payments = orders_with_payments(&db.pool, 20).await;
    payments[10].1.amount = 7;
    payments[11].1.amount = 8;
    payments[11].1.payment_id = payments[10].1.order_id;
    let all = produce_in_one_partition(&kafka, &payments).await;
    let consumer = consumer(&db, &kafka)
        .handler(rolls_back_then_checked)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    all_committed(&kafka, all.len() as i64).await;
    running.stop().await;
    assert_eq!(
        FIRST_ROLLBACK.load(Ordering::SeqCst),
        2,
        "the culprit ran again"
    );
    assert_eq!(paid(&db.pool, &payments).await, vec![1; 20]);
    let dead = dead_letters(&kafka, 1, Duration::from_secs(2)).await;
    assert!(
        dead.is_empty(),
        "{:?}",
        dead.iter()
            .map(|d| d.header("dlq_error"))
            .collect::<Vec<_>>()
    );
}

/// Calls of [`commits_on_its_own`]'s DDL.
static DDL_CALLS: AtomicUsize = AtomicUsize::new(0);

/// Pays; the message of amount 9 runs a statement that commits on its own (DDL) the first time.
#[inbox_handler]
async fn commits_on_its_own(
    event: PaymentSucceeded,
    tx: &mut MySqlConnection,
) -> Result<(), HandlerError> {
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = ?")
        .bind(event.order_id)
        .execute(&mut *tx)
        .await?;
    if event.amount == 9 && DDL_CALLS.fetch_add(1, Ordering::SeqCst) == 0 {
        tx.execute(sqlx::raw_sql("CREATE TABLE IF NOT EXISTS scratch (id INT)"))
            .await?;
    }
    Ok(())
}

/// A handler that commits the batch's transaction on its own (DDL) loses no other message's
/// effect: what ran before it committed without dedup rows and runs again (their effects
/// repeat: at least once, never lost), the handler is found and its message retried (a
/// duplicate then), and the messages after it are handled once. Fails when the batch's dedup
/// rows are written before its handlers: the DDL commits them all, and every message after
/// the handler is taken for a duplicate, never paid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_committing_on_its_own_loses_no_message() {
    let (db, kafka) = payments_setup().await;
    let mut payments = orders_with_payments(&db.pool, 20).await;
    payments[10].1.amount = 9;
    let all = produce_in_one_partition(&kafka, &payments).await;
    let consumer = consumer(&db, &kafka)
        .handler(commits_on_its_own)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    all_committed(&kafka, all.len() as i64).await;
    wait_for(
        "every message recorded",
        Duration::from_secs(30),
        || async { count(&db.pool, "SELECT COUNT(*) FROM processed_event").await == 20 },
    )
    .await;
    running.stop().await;
    let paid = paid(&db.pool, &payments).await;
    assert!(paid.iter().all(|&p| p >= 1), "none lost: {paid:?}");
    assert!(
        paid[11..].iter().all(|&p| p == 1),
        "after it, once: {paid:?}"
    );
}
