//! The relay against real PostgreSQL and both brokers: end to end, several relays with per-key
//! order, broker outages, poison records, shutdown, configuration errors.

use std::time::Duration;

use outbox_runtime::relay::{Relay, RelayBuilder};
use outbox_runtime::{Error, Uow};
use outbox_tests::deposits::{
    check_delivery, consume_all, deposit, emit_events, relay_on, wait_until_published, Deposited,
    PARTITIONS, TOPIC,
};
use outbox_tests::kafka::{consume, Kafka};
use outbox_tests::payments::wait_for;
use outbox_tests::{count, ChildGuard, Running, TestDb};
use sqlx::PgPool;

/// The shared relay fixture with these tests' own pace: polling every 200 ms, retries backing
/// off from 100 ms to 1 s.
fn relay(db: &TestDb, kafka: &Kafka) -> RelayBuilder {
    relay_on(&db.pool, kafka)
        .poll_interval(Duration::from_millis(200))
        .retry_backoff(Duration::from_millis(100), Duration::from_secs(1))
}

async fn end_to_end(kafka: Kafka) {
    let db = TestDb::new().await;
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let relay = relay(&db, &kafka).build().unwrap();
    let running = Running::relay(&relay);
    let n = emit_events(&db.pool, 50, 20, 100).await;
    let received = consume_all(&kafka, n, Duration::from_secs(60)).await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    let duplicates = check_delivery(&db.pool, &received, n).await;
    assert_eq!(duplicates, 0, "no duplicates without failures");
    let status = relay.status().await.unwrap();
    assert_eq!((status.unpublished, status.parked), (0, 0));
    assert_eq!(status.oldest_unpublished_age, None);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_on_the_mock_cluster() {
    end_to_end(Kafka::mock()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_on_tansu() {
    end_to_end(Kafka::tansu().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_keep_per_key_order_while_writes_continue() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    // Four relays as four separate instances, each with its own producer, as four processes.
    let relays: Vec<_> = (0..4)
        .map(|_| Running::relay(&relay(&db, &kafka).batch_size(250).build().unwrap()))
        .collect();
    // 20,000 events over 500 keys, written while the relays run.
    let n = emit_events(&db.pool, 500, 40, 250).await;
    assert_eq!(n, 20_000);
    let received = consume_all(&kafka, n, Duration::from_secs(120)).await;
    wait_until_published(&db.pool, Duration::from_secs(60)).await;
    let duplicates = check_delivery(&db.pool, &received, n).await;
    println!("4 relays, {n} events over 500 keys: none lost, per-key order kept, {duplicates} duplicates");
    // The four really shared the work: each owns a fair share (16) of the 64 shards.
    let shares: Vec<i64> = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
         AND classid = 'outbox_event'::regclass AND objid::int8 >= 1392508928 \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         GROUP BY pid ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(shares, [16, 16, 16, 16]);
    Running::stop_all(relays).await;
}

async fn broker_outage(mut kafka: Kafka) {
    let db = TestDb::new().await;
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let relay = relay(&db, &kafka)
        .publish_timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    let first = emit_events(&db.pool, 20, 10, 50).await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;

    kafka.stop();
    // Writes go on while the broker is down; the outbox keeps them.
    let mut written = first;
    for round in 0..5u64 {
        let events: Vec<Deposited> = (0..20).map(|k| deposit(k, 100 + round)).collect();
        let mut uow = Uow::begin(&db.pool).await.unwrap();
        uow.emit_all(&events).await.unwrap();
        uow.commit().await.unwrap();
        written += events.len();
    }
    // The relay tried, failed and kept everything: nothing new is marked.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let status = relay.status().await.unwrap();
        assert_eq!(status.parked, 0);
        if status.unpublished == (written - first) as i64 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{status:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    kafka.restart().await;
    let received = consume_all(&kafka, written, Duration::from_secs(90)).await;
    wait_until_published(&db.pool, Duration::from_secs(60)).await;
    let duplicates = check_delivery(&db.pool, &received, written).await;
    println!("broker outage: {written} events, none lost, {duplicates} duplicates");
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_on_the_mock_cluster() {
    broker_outage(Kafka::mock()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_on_tansu() {
    broker_outage(Kafka::tansu().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_record_is_parked_and_the_rest_flow() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let mut huge = deposit(7, 1);
    huge.note = "y".repeat(64 * 1024);
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit(&deposit(7, 0)).await.unwrap();
    let poison_id = uow.emit(&huge).await.unwrap();
    uow.emit(&deposit(7, 2)).await.unwrap();
    uow.emit_all(&(0..20).map(|k| deposit(k + 100, 0)).collect::<Vec<_>>())
        .await
        .unwrap();
    uow.commit().await.unwrap();

    let mut config = rdkafka::ClientConfig::new();
    config.set("message.max.bytes", "16384");
    let relay = relay(&db, &kafka)
        .producer_config(config)
        .brokers(kafka.bootstrap())
        .max_attempts(3)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(100))
        .build()
        .unwrap();
    let running = Running::relay(&relay);

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        let status = relay.status().await.unwrap();
        if status.parked == 1 && status.unpublished == 0 {
            break status;
        }
        assert!(tokio::time::Instant::now() < deadline, "{status:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status.retrying, 0);
    let (event_id, attempts, error): (uuid::Uuid, i32, String) = sqlx::query_as(
        "SELECT event_id, attempts, last_error FROM outbox_event WHERE parked_at IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((event_id, attempts), (poison_id, 3));
    assert!(error.contains("too large"), "{error}");

    // Everything else arrived, and the poison record's key kept its order around it.
    let received = consume(
        &kafka.bootstrap(),
        TOPIC,
        PARTITIONS,
        Duration::from_secs(30),
        |r| r.len() >= 22,
    )
    .await;
    assert_eq!(received.len(), 22);
    let key7: Vec<u64> = received
        .iter()
        .filter(|r| r.key == "acct-7")
        .map(|r| r.payload["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(key7, [0, 2]);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_event_wakes_the_relay_without_polling() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    // Polling alone would take an hour: only the notification can wake it in time.
    let relay = relay(&db, &kafka)
        .poll_interval(Duration::from_secs(3600))
        .failover_timeout(Duration::from_secs(7200))
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    // Let the relay go idle first: it found nothing and waits, marked as waiting.
    wait_for("the relay to listen", Duration::from_secs(10), || async {
        count(&db.pool, "SELECT count(*) FROM outbox_relay_waiting").await > 0
    })
    .await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit(&deposit(1, 1)).await.unwrap();
    uow.commit().await.unwrap();
    let received = consume(
        &kafka.bootstrap(),
        TOPIC,
        PARTITIONS,
        Duration::from_secs(20),
        |r| !r.is_empty(),
    )
    .await;
    assert_eq!(received.len(), 1);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_returns_within_the_publish_timeout_while_the_broker_is_down() {
    let db = TestDb::new().await;
    let mut kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let publish_timeout = Duration::from_secs(2);
    let relay = relay(&db, &kafka)
        .publish_timeout(publish_timeout)
        .build()
        .unwrap();
    kafka.stop();
    emit_events(&db.pool, 10, 10, 100).await;
    let running = Running::relay(&relay);
    // Wait until a batch is in flight: its rows are locked by the relay's transaction.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let in_flight = count(
            &db.pool,
            "SELECT count(*) FROM pg_stat_activity \
             WHERE application_name = 'outbox-relay' AND state = 'idle in transaction'",
        )
        .await;
        if in_flight > 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no batch in flight");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::timeout(publish_timeout + Duration::from_secs(2), running.stop())
        .await
        .expect("the relay stops within the publish timeout");
    let status = relay.status().await.unwrap();
    assert_eq!(
        status.unpublished, 100,
        "nothing was marked while the broker was down"
    );
}

#[test]
fn build_refuses_unsafe_or_invalid_settings() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pool = rt.block_on(async { PgPool::connect_lazy("postgres://localhost/x").unwrap() });
    let base = || Relay::builder(pool.clone()).brokers("127.0.0.1:9092");
    let err = |b: RelayBuilder| match b.build() {
        Err(Error::Config(msg)) => msg,
        other => panic!("expected a configuration error, got {other:?}"),
    };
    let with = |key: &str, value: &str| {
        let mut c = rdkafka::ClientConfig::new();
        c.set(key, value);
        base().producer_config(c)
    };
    assert!(err(with("enable.idempotence", "false")).contains("must be idempotent"));
    assert!(err(with("acks", "1")).contains("acks=1 is not allowed"));
    assert!(err(with("request.required.acks", "0")).contains("acks=0 is not allowed"));
    assert!(err(base().batch_size(0)).contains("batch_size"));
    assert!(err(base().poll_interval(Duration::ZERO)).contains("poll_interval"));
    assert!(err(base().max_attempts(0)).contains("max_attempts"));
    assert!(err(Relay::builder(pool.clone())).contains("no Kafka brokers"));
    assert!(base().build().is_ok());
    assert!(with("acks", "all").build().is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_process_killed_mid_batch_loses_nothing() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let n = emit_events(&db.pool, 200, 100, 1000).await;
    let start = || {
        ChildGuard(
            std::process::Command::new(env!("CARGO_BIN_EXE_outbox-test-relay"))
                .args([&db.url, &kafka.bootstrap(), "50"])
                .spawn()
                .expect("start relay process"),
        )
    };
    let mut child = start();
    // Kill it once it has published something and is inside a batch.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (published, in_batch): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL), \
                    (SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
                       AND state IN ('idle in transaction', 'active'))",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if published > 0 && in_batch > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "relay process made no progress"
        );
    }
    child.kill();
    let left = outbox_runtime::admin::status(&db.pool)
        .await
        .unwrap()
        .outbox_total()
        .unpublished;
    assert!(
        left > 0 && (left as usize) < n,
        "killed mid-stream: {left} of {n} left"
    );

    let mut child = start();
    let received = consume_all(&kafka, n, Duration::from_secs(120)).await;
    wait_until_published(&db.pool, Duration::from_secs(60)).await;
    child.kill();
    let duplicates = check_delivery(&db.pool, &received, n).await;
    println!("relay killed with {left} of {n} unpublished: none lost, {duplicates} duplicates");
}
