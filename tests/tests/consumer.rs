//! Consumers against real PostgreSQL and the mock cluster: inbox mode and its processors,
//! what `build` refuses, a lost topic replayed. The dedup contract both databases share
//! (effects once, dead letters, retries, stopping, a consumer killed) is `consumer_contract.rs`.

use std::time::Duration;

use outbox_runtime::inbox::{Consumer, ConsumerBuilder, HandlerError, Mode};
use outbox_tests::fixtures::{self, PaymentSucceeded, PAYMENTS};
use outbox_tests::kafka::{committed_total, Kafka};
use outbox_tests::payments::{
    builder, orders_with_payments, paid_counts, publish, setup, wait_for, PARTITIONS,
};
use outbox_tests::{count, Running, TestDb};
use sqlx::PgPool;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_handler_failing_twice_then_succeeding_takes_effect_once() {
    let (db, kafka) = setup().await;
    let payments = orders_with_payments(&db.pool, 1).await;
    publish(&kafka, &payments).await;
    let consumer = builder(&db, &kafka, "orders")
        .handler(fixtures::flaky_mark_paid)
        .mode(Mode::Inbox)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for("the row processed", Duration::from_secs(30), || async {
        sqlx::query_scalar("SELECT processed FROM inbox_event")
            .fetch_optional(&db.pool)
            .await
            .unwrap()
            .unwrap_or(false)
    })
    .await;
    running.stop().await;
    let (attempts, last_error): (i32, Option<String>) =
        sqlx::query_as("SELECT attempts, last_error FROM inbox_event")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(attempts, 2, "two failed attempts recorded");
    assert!(last_error.unwrap().contains("the payment service is busy"));
    assert_eq!(
        paid_counts(&db.pool).await,
        [1],
        "failed attempts left nothing behind"
    );
    assert_eq!(fixtures::flaky_calls(payments[0].1.order_id), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_inbox_processors_process_each_of_10000_events_once() {
    let (db, kafka) = setup().await;
    let payments = orders_with_payments(&db.pool, 10_000).await;
    publish(&kafka, &payments).await;
    let consumer = builder(&db, &kafka, "orders")
        .handler(fixtures::mark_order_paid)
        .mode(Mode::Inbox)
        .processors(2)
        .batch_size(200)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for("10,000 processed", Duration::from_secs(120), || async {
        count(&db.pool, "SELECT count(*) FROM inbox_event WHERE processed").await == 10_000
    })
    .await;
    running.stop().await;
    assert_eq!(paid_counts(&db.pool).await, vec![1; 10_000]);
    let status = consumer.inbox_status().await.unwrap();
    assert_eq!((status.unprocessed, status.dead), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_burst_is_received_at_once_and_processed_at_the_handlers_pace() {
    let (db, kafka) = setup().await;
    let payments = orders_with_payments(&db.pool, 20_000).await;
    let consumer = builder(&db, &kafka, "orders")
        .handler(fixtures::gated_mark_paid)
        .mode(Mode::Inbox)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    publish(&kafka, &payments).await;
    // The handler is blocked, yet receipt takes the whole burst.
    wait_for("20,000 received", Duration::from_secs(120), || async {
        consumer.inbox_status().await.unwrap().unprocessed == 20_000
    })
    .await;
    wait_for(
        "offsets committed for the whole burst",
        Duration::from_secs(30),
        || async { committed_total(&kafka.bootstrap(), "orders", PAYMENTS, PARTITIONS) == 20_000 },
    )
    .await;
    let paid: i64 = sqlx::query_scalar("SELECT sum(paid) FROM orders")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(paid, 0, "nothing processed while the handler waits");
    fixtures::GATE.add_permits(20_000);
    wait_for("20,000 processed", Duration::from_secs(120), || async {
        consumer.inbox_status().await.unwrap().unprocessed == 0
    })
    .await;
    running.stop().await;
    assert_eq!(
        paid_counts(&db.pool).await,
        vec![1; 20_000],
        "none lost, none twice"
    );
}

#[test]
fn build_refuses_invalid_settings() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pool = rt.block_on(async { PgPool::connect_lazy("postgres://localhost/x").unwrap() });
    let base = || {
        Consumer::builder(pool.clone())
            .brokers("127.0.0.1:9092")
            .group_id("g")
    };
    let err = |b: ConsumerBuilder| match b.build() {
        Err(outbox_runtime::Error::Config(msg)) => msg,
        other => panic!("expected a configuration error, got {other:?}"),
    };
    assert!(err(base()).contains("no handlers"));
    assert!(err(Consumer::builder(pool.clone())
        .group_id("g")
        .handler(fixtures::mark_order_paid))
    .contains("no Kafka brokers"));
    assert!(err(Consumer::builder(pool.clone())
        .brokers("b:9092")
        .handler(fixtures::mark_order_paid))
    .contains("no consumer group"));
    let mut store = rdkafka::ClientConfig::new();
    store.set("enable.auto.offset.store", "true");
    assert!(err(base()
        .handler(fixtures::mark_order_paid)
        .consumer_config(store))
    .contains("enable.auto.offset.store must stay false"));
    assert!(err(base()
        .handler(fixtures::mark_order_paid)
        .handler(fixtures::mark_order_paid))
    .contains("handler `mark_order_paid` is registered twice"));
    assert!(
        err(base().handler(fixtures::mark_order_paid).max_attempts(0)).contains("max_attempts")
    );
    let suffixes = base()
        .handler(fixtures::mark_order_paid)
        .retry_suffix(".dlq");
    assert!(err(suffixes).contains("suffixes must differ"));
    assert!(err(base().handler(fixtures::mark_order_paid).retry_suffix("")).contains("empty"));
    assert!(err(base().handler(fixtures::mark_order_paid).retry_tiers(0)).contains("retry_tiers"));
    // An explicit name equal to another handler's default key in this group.
    assert!(err(base()
        .handler(fixtures::mark_order_paid)
        .handler(explicitly_named_like_the_default))
    .contains("share the deduplication key `g/mark_order_paid`"));
    assert!(base().handler(fixtures::mark_order_paid).build().is_ok());
}

#[outbox_runtime::inbox_handler(name = "g/mark_order_paid")]
async fn explicitly_named_like_the_default(
    _event: PaymentSucceeded,
    _tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    Ok(())
}

/// The broker-loss drill on a broker process (R-DIST-OBX-3: the service's database is the
/// single source of truth): events published and handled; the topic deleted and created again,
/// empty; `replay` publishes the outbox's events again; the consumer, reading the new topic from
/// its start, skips every one of them; the events written afterwards are handled, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_topic_replayed_is_handled_once_on_tansu() {
    use outbox_runtime::admin::{Replay, ReplayFilter};
    use outbox_tests::deposits::{
        create_steps, deposit, emit_events, record_step, relay_on, steps, wait_until_published,
        TOPIC,
    };

    let mut kafka = Kafka::tansu().await;
    let db = TestDb::new().await;
    create_steps(&db.pool).await;
    kafka.create_topic(TOPIC, 3).await;
    kafka.create_topic(&format!("{TOPIC}.retry"), 3).await;
    kafka.create_topic(&format!("{TOPIC}.dlq"), 1).await;
    let relay = relay_on(&db.pool, &kafka).build().unwrap();
    let relaying = Running::relay(&relay);
    let n = emit_events(&db.pool, 10, 10, 50).await;
    wait_until_published(&db.pool, Duration::from_secs(60)).await;
    let consumer = builder(&db, &kafka, "ledger")
        .handler(record_step)
        .build()
        .unwrap();
    let consuming = Running::consumer(&consumer);
    let pool = db.pool.clone();
    wait_for("every event handled", Duration::from_secs(60), || async {
        count(&pool, "SELECT count(*) FROM steps").await == n as i64
    })
    .await;

    // The broker loses everything: the topics, their records, the group's offsets. (The
    // clients are stopped meanwhile: librdkafka 2.12.1's metadata cache crashes on what tansu
    // answers about a topic gone under a live client.) The operator creates the topics again.
    consuming.stop().await;
    relaying.stop().await;
    kafka.lose_everything().await;
    kafka.create_topic(TOPIC, 3).await;
    kafka.create_topic(&format!("{TOPIC}.retry"), 3).await;
    kafka.create_topic(&format!("{TOPIC}.dlq"), 1).await;
    let replay = Replay::new(db.pool.clone(), &kafka.bootstrap()).unwrap();
    let replayed = replay
        .run(&ReplayFilter::topic(TOPIC), None, |_| {})
        .await
        .unwrap();
    assert_eq!(replayed.published as usize, n);
    // One more event per account after the replay: once each is handled, so is every replayed
    // event before it in its partition.
    let consuming = Running::consumer(&consumer);
    let relaying = Running::relay(&relay);
    let mut uow = outbox_runtime::Uow::begin(&db.pool).await.unwrap();
    for account in 0..10 {
        uow.emit(&deposit(account, 10)).await.unwrap();
    }
    uow.commit().await.unwrap();
    wait_for(
        "the new events handled",
        Duration::from_secs(120),
        || async { count(&pool, "SELECT count(*) FROM steps").await >= n as i64 + 10 },
    )
    .await;
    consuming.stop().await;
    relaying.stop().await;
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM steps").await,
        n as i64 + 10
    );
    for (account, seqs) in steps(&db.pool).await {
        assert_eq!(seqs, (0..=10).collect::<Vec<i64>>(), "account {account}");
    }
}
