//! The relay on MariaDB (the machine's 10.11; MySQL 8 cannot be had here): end to end, ids
//! committed out of their order, several relays sharing the shards with per-key order, a relay
//! whose session is killed, refused records (retried, parked, held with their key), and what it
//! refuses.

use std::time::Duration;

use outbox_runtime::relay::{JetStream, Relay, RelayBuilder};
use outbox_runtime::{OutboxEvent, Uow};
use outbox_tests::deposits::{consume_all, deposit, Deposited, PARTITIONS, TOPIC};
use outbox_tests::kafka::{consume, Kafka, Received};
use outbox_tests::mysql::{check_delivery, count, MySqlTestDb};
use outbox_tests::nats::NatsServer;
use outbox_tests::payments::wait_for;
use outbox_tests::Running;
use rdkafka::types::RDKafkaRespErr;
use serde::Serialize;
use sqlx::MySqlPool;

/// A relay on `db` publishing to `kafka`, quick to notice work and to retry.
fn relay(db: &MySqlTestDb, kafka: &Kafka) -> RelayBuilder {
    Relay::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .poll_interval(Duration::from_millis(100))
        .publish_timeout(Duration::from_secs(5))
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(500))
}

/// Emits `per_key` events for each of `keys` accounts, `batch` to a unit of work, from four
/// tasks at once (each its own keys, so a key's events are emitted in `seq` order). Returns
/// how many.
async fn emit_events(pool: &MySqlPool, keys: usize, per_key: u64, batch: usize) -> usize {
    let tasks: Vec<_> = (0..4)
        .map(|t| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let events: Vec<Deposited> = (1..=per_key)
                    .flat_map(|seq| {
                        (0..keys)
                            .filter(|k| k % 4 == t)
                            .map(move |k| deposit(k, seq))
                    })
                    .collect();
                for chunk in events.chunks(batch) {
                    let mut uow = Uow::begin(&pool).await.unwrap();
                    uow.emit_all(chunk).await.unwrap();
                    uow.commit().await.unwrap();
                }
                events.len()
            })
        })
        .collect();
    let mut n = 0;
    for t in tasks {
        n += t.await.unwrap();
    }
    n
}

async fn wait_until_published(pool: &MySqlPool, timeout: Duration) {
    wait_for("every outbox row published", timeout, || async {
        count(
            pool,
            "SELECT COUNT(*) FROM outbox_event WHERE published_at IS NULL",
        )
        .await
            == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_every_event_in_key_order() {
    let db = MySqlTestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let relay = relay(&db, &kafka).build().unwrap();
    let running = Running::relay(&relay);
    let n = emit_events(&db.pool, 40, 10, 25).await;
    let received = consume_all(&kafka, n, Duration::from_secs(60)).await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    assert_eq!(check_delivery(&db.pool, &received, n).await, 0);
    let status = relay.status().await.unwrap();
    assert_eq!((status.unpublished, status.parked), (0, 0));
    assert_eq!(status.oldest_unpublished_age, None);
    assert!(relay.ready().await.is_ok());
    running.stop().await;
}

/// The relay is the same on every broker: JetStream here (its own nats-server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_to_jetstream_in_key_order() {
    let db = MySqlTestDb::new().await;
    let server = NatsServer::start().await;
    server.create_stream("ACCOUNTS", TOPIC, |_| {}).await;
    let relay = Relay::builder(db.pool.clone())
        .jetstream(JetStream::new(server.client().await))
        .poll_interval(Duration::from_millis(100))
        .publish_timeout(Duration::from_secs(2))
        .failover_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    let n = emit_events(&db.pool, 40, 10, 25).await;
    let received = server
        .read_stream_when("ACCOUNTS", n as u64, Duration::from_secs(60))
        .await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    assert_eq!(check_delivery(&db.pool, &received, n).await, 0);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_id_that_commits_after_a_higher_one_is_published() {
    let db = MySqlTestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let relay = relay(&db, &kafka).build().unwrap();
    let running = Running::relay(&relay);
    // A takes its id first and stays open; B takes the next one and commits.
    let mut a = Uow::begin(&db.pool).await.unwrap();
    a.emit(&deposit(1, 1)).await.unwrap();
    a.flush().await.unwrap();
    let mut b = Uow::begin(&db.pool).await.unwrap();
    b.emit(&deposit(2, 1)).await.unwrap();
    b.commit().await.unwrap();
    // The relay publishes B's row, passing A's, which it cannot see yet.
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    a.commit().await.unwrap();
    let ids: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, CAST(partition_key AS CHAR) FROM outbox_event ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(ids, [(1, "acct-1".to_owned()), (2, "acct-2".to_owned())]);
    // A's lower id, visible only now, is published all the same.
    let received = consume_all(&kafka, 2, Duration::from_secs(30)).await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    assert_eq!(check_delivery(&db.pool, &received, 2).await, 0);
    let order: Vec<i64> = received.iter().map(Received::outbox_id).collect();
    assert!(order.contains(&1) && order.contains(&2), "{order:?}");
    running.stop().await;
}

/// The shards each live relay session holds: its connection id and how many.
async fn shard_owners(pool: &MySqlPool) -> Vec<(i64, i64)> {
    sqlx::query_as(
        "SELECT CAST(o.owner AS SIGNED), COUNT(*) FROM ( \
             SELECT IS_USED_LOCK(CONCAT('outbox:r:', MD5(DATABASE()), ':s:', bucket)) AS owner \
             FROM outbox_key_lock WHERE bucket < 64) o \
         WHERE o.owner IS NOT NULL GROUP BY o.owner ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_share_the_shards_and_keep_each_keys_order() {
    let db = MySqlTestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let relays: Vec<_> = (0..3)
        .map(|_| Running::relay(&relay(&db, &kafka).batch_size(100).build().unwrap()))
        .collect();
    // Each takes its fair share (at most 22 of the 64 shards), and all are held.
    wait_for(
        "three relays sharing the 64 shards",
        Duration::from_secs(30),
        || async {
            let owners = shard_owners(&db.pool).await;
            owners.len() == 3
                && owners.iter().map(|o| o.1).sum::<i64>() == 64
                && owners.iter().all(|o| o.1 <= 22)
        },
    )
    .await;
    let n = emit_events(&db.pool, 200, 15, 50).await;
    assert_eq!(n, 3_000);
    let received = consume_all(&kafka, n, Duration::from_secs(120)).await;
    wait_until_published(&db.pool, Duration::from_secs(60)).await;
    let duplicates = check_delivery(&db.pool, &received, n).await;
    assert_eq!(duplicates, 0, "no duplicates without failures");
    Running::stop_all(relays).await;
    // Stopped relays close their sessions: no shard stays held.
    assert!(shard_owners(&db.pool).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_relay_session_hands_its_shards_over_and_nothing_is_lost() {
    let db = MySqlTestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let relays: Vec<_> = (0..2)
        .map(|_| Running::relay(&relay(&db, &kafka).batch_size(50).build().unwrap()))
        .collect();
    wait_for(
        "two relays sharing the shards",
        Duration::from_secs(30),
        || async {
            let owners = shard_owners(&db.pool).await;
            owners.len() == 2 && owners.iter().all(|o| o.1 == 32)
        },
    )
    .await;
    let writing = tokio::spawn({
        let pool = db.pool.clone();
        async move { emit_events(&pool, 100, 20, 20).await }
    });
    // Kill one relay's session while events flow: its transaction is rolled back, its shards
    // are free at once, and the other relay takes them until the first one is back.
    wait_for(
        "rows published by both relays",
        Duration::from_secs(30),
        || async {
            count(
                &db.pool,
                "SELECT COUNT(*) FROM outbox_event WHERE published_at IS NOT NULL",
            )
            .await
                > 200
        },
    )
    .await;
    let victim = shard_owners(&db.pool).await[0].0;
    sqlx::query(&format!("KILL CONNECTION {victim}"))
        .execute(&db.pool)
        .await
        .unwrap();
    let n = writing.await.unwrap();
    let received = consume_all(&kafka, n, Duration::from_secs(120)).await;
    wait_until_published(&db.pool, Duration::from_secs(60)).await;
    let duplicates = check_delivery(&db.pool, &received, n).await;
    println!("a relay session killed under load: {n} events, none lost, {duplicates} duplicates");
    let owners = shard_owners(&db.pool).await;
    assert!(owners.iter().all(|o| o.0 != victim), "{owners:?}");
    assert_eq!(owners.iter().map(|o| o.1).sum::<i64>(), 64);
    Running::stop_all(relays).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_without_the_relays_migration_is_refused_with_what_to_run() {
    let db = MySqlTestDb::empty().await;
    let kafka = Kafka::mock();
    let relay = relay(&db, &kafka).build().unwrap();
    let e = relay.publish_pending().await.unwrap_err().to_string();
    assert!(e.contains("outbox migrate"), "{e}");
}

/// A relay with retention deletes, on its schedule, the published outbox rows and the dedup
/// rows past their windows on MariaDB, and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_beside_the_relay_deletes_what_is_past_its_window() {
    let db = MySqlTestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    emit_events(&db.pool, 4, 10, 10).await;
    // 40 rows: 20 published 40 days ago, 10 parked 40 days ago, 10 left to publish; dedup rows
    // 10 days old (past the 7-day window) and new.
    sqlx::raw_sql(
        "UPDATE outbox_event SET published_at = UTC_TIMESTAMP(6) - INTERVAL 40 DAY \
         ORDER BY id LIMIT 20; \
         UPDATE outbox_event SET parked_at = UTC_TIMESTAMP(6) - INTERVAL 40 DAY \
         WHERE published_at IS NULL ORDER BY id LIMIT 10; \
         INSERT INTO processed_event (event_id, handler, processed_at) \
         SELECT event_id, 'g/old', UTC_TIMESTAMP(6) - INTERVAL 10 DAY FROM outbox_event; \
         INSERT INTO processed_event (event_id, handler, processed_at) \
         SELECT event_id, 'g/new', UTC_TIMESTAMP(6) FROM outbox_event",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let day = Duration::from_secs(86_400);
    let retention = outbox_runtime::admin::Retention::new(5 * day)
        .dedup_older_than(7 * day)
        .batch_size(3);
    let publishing = relay(&db, &kafka).retention(retention).build().unwrap();
    let running = Running::relay(&publishing);
    wait_for("the old rows deleted", Duration::from_secs(30), || async {
        count(&db.pool, "SELECT COUNT(*) FROM outbox_event").await == 20
            && count(&db.pool, "SELECT COUNT(*) FROM processed_event").await == 40
    })
    .await;
    wait_for("the rest published", Duration::from_secs(30), || async {
        count(
            &db.pool,
            "SELECT COUNT(*) FROM outbox_event WHERE published_at IS NULL AND parked_at IS NULL",
        )
        .await
            == 0
    })
    .await;
    running.stop().await;
    assert_eq!(
        count(
            &db.pool,
            "SELECT COUNT(*) FROM outbox_event WHERE parked_at IS NOT NULL"
        )
        .await,
        10,
        "parked rows kept"
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT COUNT(*) FROM processed_event WHERE handler = 'g/new'"
        )
        .await,
        40,
        "new dedup rows kept"
    );
    let e = relay(&db, &kafka)
        .retention(outbox_runtime::admin::Retention::new(30 * day).dedup_older_than(day))
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("dedup_older_than"), "{e}");
}

/// The relay's status once `done` holds, within 30 s.
async fn status_when(
    relay: &Relay,
    what: &str,
    done: impl Fn(&outbox_runtime::relay::RelayStatus) -> bool,
) -> outbox_runtime::relay::RelayStatus {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = relay.status().await.unwrap();
        if done(&status) {
            return status;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: {status:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_record_counts_attempts_then_parks_with_its_error() {
    let db = MySqlTestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 1).await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit(&deposit(1, 0)).await.unwrap();
    uow.commit().await.unwrap();
    kafka.fail_produce_requests(&[RDKafkaRespErr::RD_KAFKA_RESP_ERR_INVALID_REQUEST; 20]);
    let relay = relay(&db, &kafka).max_attempts(3).build().unwrap();
    let running = Running::relay(&relay);
    let status = status_when(&relay, "parked", |s| s.parked == 1).await;
    assert_eq!((status.unpublished, status.retrying), (0, 0), "{status:?}");
    let (attempts, error, waiting): (i32, String, i64) = sqlx::query_as(
        "SELECT attempts, CAST(last_error AS CHAR), next_attempt_at IS NOT NULL \
         FROM outbox_event",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((attempts, waiting), (3, 0));
    assert!(error.contains("Invalid request"), "{error}");
    running.stop().await;
}

#[derive(Serialize, OutboxEvent)]
#[outbox(
    topic = "account.audit",
    aggregate_type = "Account",
    event_type = "Audited"
)]
struct Audited {
    #[outbox(aggregate_id)]
    account: String,
    seq: u64,
}

/// Producer settings of a broker that does not create topics on first use.
fn no_auto_create() -> rdkafka::ClientConfig {
    let mut config = rdkafka::ClientConfig::new();
    config.set("allow.auto.create.topics", "false");
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_holds_its_key_and_only_its_key_until_it_exists() {
    let db = MySqlTestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    // acct-1: a deposit, an audit event (its topic missing), two more deposits; acct-2:
    // deposits only.
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit(&deposit(1, 0)).await.unwrap();
    uow.emit(&Audited {
        account: "acct-1".into(),
        seq: 1,
    })
    .await
    .unwrap();
    uow.emit(&deposit(1, 2)).await.unwrap();
    uow.emit(&deposit(1, 3)).await.unwrap();
    for seq in 0..3 {
        uow.emit(&deposit(2, seq)).await.unwrap();
    }
    uow.commit().await.unwrap();
    let relay = relay(&db, &kafka)
        .producer_config(no_auto_create())
        .brokers(kafka.bootstrap())
        .max_attempts(2)
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    let early = consume(
        &kafka.bootstrap(),
        TOPIC,
        PARTITIONS,
        Duration::from_secs(30),
        |r| r.len() >= 4,
    )
    .await;
    let status = status_when(&relay, "held", |s| s.held == 1).await;
    assert_eq!((status.unpublished, status.parked), (3, 0), "{status:?}");
    // Held, never parked, however many tries (max_attempts is 2); acct-1's later deposits
    // wait behind it while acct-2's went out.
    wait_for(
        "the held record tried twice more",
        Duration::from_secs(30),
        || async {
            // Each try sets its next one 500 ms on (the backoff's cap): past 1.2 s from the first
            // hold, it was tried at least three times in all.
            count(
                &db.pool,
                "SELECT COUNT(*) FROM outbox_event \
             WHERE TIMESTAMPDIFF(MICROSECOND, held_at, next_attempt_at) > 1200000",
            )
            .await
                == 1
        },
    )
    .await;
    let status = relay.status().await.unwrap();
    assert_eq!((status.held, status.parked), (1, 0), "{status:?}");
    let acct1: Vec<u64> = early
        .iter()
        .filter(|r| r.key == "acct-1")
        .map(|r| r.payload["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(acct1, [0]);
    assert_eq!(early.iter().filter(|r| r.key == "acct-2").count(), 3);
    let attempts = count(&db.pool, "SELECT MAX(attempts) FROM outbox_event").await;
    assert_eq!(attempts, 0, "a hold is not an attempt");
    // The health check names the held topic, its key and the broker's error.
    let health = outbox_runtime::mysql::health(&db.pool, &Default::default())
        .await
        .unwrap();
    let held: Vec<String> = health
        .warnings
        .iter()
        .filter(|w| w.kind() == outbox_runtime::admin::WarningKind::HeldKeys)
        .map(ToString::to_string)
        .collect();
    assert_eq!(held.len(), 1, "{:?}", health.warnings);
    assert!(held[0].contains("account.audit"), "{}", held[0]);
    // The topic appears: the audit event goes out, then the deposits behind it, in order.
    kafka.create_topic("account.audit", 1).await;
    wait_until_published(&db.pool, Duration::from_secs(60)).await;
    let deposits = consume_all(&kafka, 6, Duration::from_secs(30)).await;
    let acct1: Vec<u64> = deposits
        .iter()
        .filter(|r| r.key == "acct-1")
        .map(|r| r.payload["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(acct1, [0, 2, 3]);
    let status = relay.status().await.unwrap();
    assert_eq!((status.held, status.parked, status.unpublished), (0, 0, 0));
    running.stop().await;
}

/// Parked rows on MariaDB: a listing narrowed by topic, event type, ids, event ids, time, page
/// and limit; a retry and a drop change exactly the rows a listing with their filter shows; a
/// retried row is published by the relay's next claim (no cursor skips it), keeping its last
/// error and recording who retried it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_rows_are_listed_retried_and_dropped_by_filter() {
    use outbox_runtime::admin::PoisonFilter;
    use outbox_runtime::mysql::{count_parked, drop_parked, list_parked, retry_parked};

    let db = MySqlTestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 1).await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    let events: Vec<_> = (0..5).map(|k| deposit(k, 0)).collect();
    let event_ids = uow.emit_all(&events).await.unwrap();
    uow.commit().await.unwrap();
    kafka.fail_produce_requests(&[RDKafkaRespErr::RD_KAFKA_RESP_ERR_INVALID_REQUEST; 50]);
    let parking = relay(&db, &kafka).max_attempts(1).build().unwrap();
    let running = Running::relay(&parking);
    status_when(&parking, "all parked", |s| s.parked == 5).await;
    running.stop().await;
    kafka.clear_produce_errors();

    let all = list_parked(&db.pool, &PoisonFilter::all()).await.unwrap();
    let ids: Vec<i64> = all.iter().map(|r| r.id).collect();
    assert_eq!(
        all.iter().map(|r| r.event_id).collect::<Vec<_>>(),
        event_ids,
        "the oldest first"
    );
    let first = &all[0];
    assert_eq!(
        (first.topic.as_str(), first.partition_key.as_str()),
        (TOPIC, "acct-0")
    );
    assert_eq!(
        (first.event_type.as_str(), first.aggregate_type.as_str()),
        ("Deposited", "Account")
    );
    assert_eq!(
        (first.attempts, first.payload["seq"].as_u64()),
        (1, Some(0))
    );
    assert!(
        first
            .last_error
            .as_deref()
            .unwrap()
            .contains("Invalid request"),
        "{first:?}"
    );
    assert!(first.parked_at >= first.created_at, "{first:?}");

    let listed = |filter: PoisonFilter| {
        let pool = db.pool.clone();
        async move {
            let rows = list_parked(&pool, &filter).await.unwrap();
            let n = count_parked(&pool, &filter).await.unwrap();
            assert_eq!(n as usize, rows.len(), "{filter:?}");
            rows.iter().map(|r| r.id).collect::<Vec<_>>()
        }
    };
    let by_ids = PoisonFilter::all().id(ids[1]).event_id(event_ids[3]);
    assert_eq!(listed(by_ids).await, [ids[1], ids[3]]);
    let page = PoisonFilter::all().after_id(ids[1]).limit(2);
    assert_eq!(listed(page).await, [ids[2], ids[3]]);
    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    assert_eq!(listed(PoisonFilter::all().since(later)).await, [0i64; 0]);
    assert_eq!(listed(PoisonFilter::all().until(later)).await, ids);
    assert_eq!(listed(PoisonFilter::all().topic("other")).await, [0i64; 0]);
    assert_eq!(
        listed(PoisonFilter::all().event_type("Withdrawn")).await,
        [0i64; 0]
    );
    assert_eq!(
        listed(PoisonFilter::all().topic(TOPIC).limit(3)).await,
        ids[..3]
    );

    // A retry of the two oldest: un-parked, attempts reset, error kept, retry recorded.
    let retried = retry_parked(&db.pool, &PoisonFilter::all().limit(2))
        .await
        .unwrap();
    assert_eq!(retried, 2);
    assert_eq!(listed(PoisonFilter::all()).await, ids[2..]);
    let (attempts, error, by): (i32, String, String) = sqlx::query_as(
        "SELECT attempts, CAST(last_error AS CHAR), CAST(retried_by AS CHAR) \
         FROM outbox_event WHERE id = ? AND retried_at IS NOT NULL",
    )
    .bind(ids[0])
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (attempts, by.as_str()),
        (0, "outbox_runtime::mysql::retry_parked")
    );
    assert!(error.contains("Invalid request"), "{error}");
    let too_long = "x".repeat(256);
    let e = outbox_runtime::mysql::retry_parked_by(&db.pool, &PoisonFilter::all(), &too_long)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("255"), "{e}");
    assert_eq!(
        listed(PoisonFilter::all()).await,
        ids[2..],
        "nothing retried"
    );

    // The relay publishes the two retried rows and leaves the parked ones.
    let relay = relay(&db, &kafka).build().unwrap();
    assert_eq!(relay.publish_pending().await.unwrap(), 2);
    let received = consume(&kafka.bootstrap(), TOPIC, 1, Duration::from_secs(30), |r| {
        r.len() >= 2
    })
    .await;
    let sent: Vec<&str> = received.iter().map(|r| r.header("event_id")).collect();
    assert_eq!(sent, [event_ids[0].to_string(), event_ids[1].to_string()]);

    // A drop of one row by its event id and type; the last parked row stays.
    let one = PoisonFilter::all()
        .event_type("Deposited")
        .event_id(event_ids[3]);
    assert_eq!(drop_parked(&db.pool, &one).await.unwrap(), 1);
    assert_eq!(listed(PoisonFilter::all()).await, [ids[2], ids[4]]);
    assert_eq!(
        count(&db.pool, "SELECT COUNT(*) FROM outbox_event").await,
        4
    );
}

/// `mysql::health` warns of a transaction waiting for a lock longer than `lock_wait`, naming
/// the connection that waits and the one whose transaction holds the lock (what `KILL` ends);
/// the warning goes once the holder ends its transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_waiting_for_a_lock_is_warned_of_with_its_holder() {
    use outbox_runtime::admin::{HealthThresholds, Warning, WarningKind};

    let db = MySqlTestDb::new().await;
    let thresholds = HealthThresholds::default().lock_wait(Duration::from_secs(1));
    let mut holder = db.connection().await;
    sqlx::raw_sql("BEGIN; SELECT bucket FROM outbox_key_lock WHERE bucket = 7 FOR UPDATE")
        .execute(&mut holder)
        .await
        .unwrap();
    let holder_id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
        .fetch_one(&mut holder)
        .await
        .unwrap();
    let mut waiter = db.connection().await;
    let waiter_id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
        .fetch_one(&mut waiter)
        .await
        .unwrap();
    let waiting = tokio::spawn(async move {
        use sqlx::Executor;
        let lock = "BEGIN; SELECT bucket FROM outbox_key_lock WHERE bucket = 7 FOR UPDATE";
        waiter.execute(sqlx::raw_sql(lock)).await.unwrap();
        waiter.execute(sqlx::raw_sql("ROLLBACK")).await.unwrap();
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let warning = loop {
        let health = outbox_runtime::mysql::health(&db.pool, &thresholds)
            .await
            .unwrap();
        if let Some(w) = health
            .warnings
            .iter()
            .find(|w| w.kind() == WarningKind::LockWait)
        {
            break w.clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never warned: {:?}",
            health.warnings
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let Warning::LockWait {
        thread_id,
        waited_secs,
        blocking_thread_id,
        ..
    } = &warning
    else {
        panic!("{warning:?}")
    };
    assert_eq!(
        (*thread_id, *blocking_thread_id),
        (waiter_id, Some(holder_id))
    );
    assert!(*waited_secs >= 1.0, "{warning:?}");
    assert!(warning.to_string().contains("user outbox"), "{warning}");
    let text = warning.to_string();
    assert!(text.contains(&format!("KILL {holder_id}")), "{text}");
    // Ages are the same from a session in another time zone (InnoDB's times are the server's
    // system zone's; sqlx sets its sessions to UTC, an application may set any).
    let options: sqlx::mysql::MySqlConnectOptions = db.url.parse().unwrap();
    let shifted = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(options.timezone(Some("+05:00".to_owned())))
        .await
        .unwrap();
    let patient = HealthThresholds::default().lock_wait(Duration::from_secs(3600));
    let health = outbox_runtime::mysql::health(&shifted, &patient)
        .await
        .unwrap();
    assert!(
        health
            .warnings
            .iter()
            .all(|w| w.kind() != WarningKind::LockWait),
        "{:?}",
        health.warnings
    );
    let oldest = health.oldest_transaction_age_secs.unwrap();
    assert!((0.0..600.0).contains(&oldest), "{oldest}");
    shifted.close().await;
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    waiting.await.unwrap();
    // (InnoDB's transaction tables are a snapshot, refreshed by a read only when none was made
    // in the last 0.1 s: polled any faster, it would never change.)
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let health = outbox_runtime::mysql::health(&db.pool, &thresholds)
            .await
            .unwrap();
        if health
            .warnings
            .iter()
            .all(|w| w.kind() != WarningKind::LockWait)
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never cleared: {:?}",
            health.warnings
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let default = HealthThresholds::default();
    assert_eq!(
        default.clone(),
        default.lock_wait(Duration::from_secs(10)),
        "10 s by default"
    );
}

/// A retry or a drop of more parked rows than a prepared statement takes placeholders (65,535),
/// each named, as `outbox parked retry --all` names the rows it listed: all of them changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_rows_past_the_placeholder_limit_are_retried_and_dropped() {
    use outbox_runtime::admin::PoisonFilter;
    use outbox_runtime::mysql::{drop_parked, list_parked, retry_parked};

    let db = MySqlTestDb::new().await;
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
             topic, partition_key, key_bucket, created_at, attempts, parked_at, last_error) \
         SELECT UNHEX(REPLACE(UUID(), '-', '')), 'Account', 'a', 'Deposited', '{}', \
                'account.events', CONCAT('k', a.bucket), a.bucket, UTC_TIMESTAMP(6), 5, \
                UTC_TIMESTAMP(6), 'refused' \
         FROM outbox_key_lock a CROSS JOIN (SELECT 0 AS n UNION ALL SELECT 1) b \
         LIMIT 70000",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let rows = list_parked(&db.pool, &PoisonFilter::all()).await.unwrap();
    assert_eq!(rows.len(), 70_000);
    let (first, rest) = rows.split_at(36_000);
    let by_id = first.iter().fold(PoisonFilter::all(), |f, r| f.id(r.id));
    let by_event_id = rest
        .iter()
        .fold(PoisonFilter::all(), |f, r| f.event_id(r.event_id));
    let all = rows
        .iter()
        .fold(PoisonFilter::all(), |f, r| f.id(r.id).event_id(r.event_id));
    assert_eq!(retry_parked(&db.pool, &all).await.unwrap(), 70_000);
    let parked = "SELECT COUNT(*) FROM outbox_event WHERE parked_at IS NOT NULL";
    assert_eq!(count(&db.pool, parked).await, 0);
    sqlx::query("UPDATE outbox_event SET parked_at = UTC_TIMESTAMP(6)")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(drop_parked(&db.pool, &by_id).await.unwrap(), 36_000);
    assert_eq!(drop_parked(&db.pool, &by_event_id).await.unwrap(), 34_000);
    assert_eq!(
        count(&db.pool, "SELECT COUNT(*) FROM outbox_event").await,
        0
    );
}
