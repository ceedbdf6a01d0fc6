//! The relay under faults and odd conditions: stale planner statistics and large backlogs,
//! records that fail at delivery, a producer that fails for good, an unknown broker error, a
//! missing topic, a relay host that vanishes, two installations in one database.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use outbox_runtime::relay;
use outbox_runtime::{OutboxEvent, Uow};
use outbox_tests::deposits::{
    check_delivery, consume_all, deposit, emit_events, relay_on, wait_until_published, PARTITIONS,
    TOPIC,
};
use outbox_tests::kafka::{consume, Kafka, Received};
use outbox_tests::proxy::Proxy;
use outbox_tests::{Running, TestDb};
use rdkafka::types::RDKafkaRespErr;
use serde::Serialize;
use sqlx::PgPool;

/// Producer settings of a broker that does not create topics on first use.
fn no_auto_create() -> rdkafka::ClientConfig {
    let mut config = rdkafka::ClientConfig::new();
    config.set("allow.auto.create.topics", "false");
    config
}

/// Shared buffers (hit + read) of a plan: its top node's, which include its children's.
fn buffers(plan: &serde_json::Value) -> i64 {
    let node = &plan[0]["Plan"];
    node["Shared Hit Blocks"].as_i64().unwrap_or(0)
        + node["Shared Read Blocks"].as_i64().unwrap_or(0)
}

fn node_types(node: &serde_json::Value, out: &mut Vec<String>) {
    if let Some(t) = node["Node Type"].as_str() {
        out.push(t.to_owned());
    }
    if let Some(children) = node["Plans"].as_array() {
        for child in children {
            node_types(child, out);
        }
    }
}

/// Writes `n` outbox rows over 1,000 keys with one statement (as a burst of emits would).
async fn backlog(pool: &PgPool, n: i64) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key) \
         SELECT gen_random_uuid(), 'Account', 'acct-' || (g % 1000), 'Deposited', \
                jsonb_build_object('seq', g, 'note', repeat('x', 40)), 'account.events', \
                'acct-' || (g % 1000) \
         FROM generate_series(1, $1) AS g",
    )
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// The buffers one claim of 500 touches, and its plan's node types.
async fn claim_cost(pool: &PgPool, cursor: i64) -> (i64, Vec<String>) {
    let plan = relay::explain_claim(pool, cursor, 500).await.unwrap();
    let mut types = Vec::new();
    node_types(&plan[0]["Plan"], &mut types);
    (buffers(&plan), types)
}

/// A claim costs what its batch costs: on a table the planner knows nothing about (never
/// analyzed, as after a migration or a burst, with autovacuum behind), on one analyzed while
/// empty, and on one analyzed, with a backlog 20 times larger, and with a long stretch of rows
/// published since the last vacuum in front of it.
#[tokio::test]
async fn a_claim_costs_the_same_whatever_the_backlog_and_the_statistics() {
    let small = TestDb::new().await;
    backlog(&small.pool, 10_000).await;
    let (base, _) = claim_cost(&small.pool, 0).await;

    let large = TestDb::new().await;
    backlog(&large.pool, 200_000).await;
    let (never_analyzed, types) = claim_cost(&large.pool, 0).await;
    assert!(
        !types.iter().any(|t| t == "Sort" || t.starts_with("Bitmap")),
        "the claim walks the unpublished index in id order: {types:?}"
    );

    let stale = TestDb::new().await;
    sqlx::query("ANALYZE outbox_event")
        .execute(&stale.pool)
        .await
        .unwrap();
    backlog(&stale.pool, 200_000).await;
    let (analyzed_empty, _) = claim_cost(&stale.pool, 0).await;

    sqlx::query("ANALYZE outbox_event")
        .execute(&large.pool)
        .await
        .unwrap();
    let (analyzed, _) = claim_cost(&large.pool, 0).await;

    // 100,000 rows published since the last vacuum: their index entries are still there. The
    // relay's cursor is past them.
    sqlx::query("UPDATE outbox_event SET published_at = now() WHERE id <= 100000")
        .execute(&large.pool)
        .await
        .unwrap();
    let (behind_published, _) = claim_cost(&large.pool, 100_000).await;

    println!(
        "claim of 500, shared buffers: 10k backlog {base}; 200k never analyzed {never_analyzed}, \
         analyzed while empty {analyzed_empty}, analyzed {analyzed}, behind 100k published \
         {behind_published}"
    );
    for (case, cost) in [
        ("never analyzed", never_analyzed),
        ("analyzed while empty", analyzed_empty),
        ("analyzed", analyzed),
        ("behind 100k published rows", behind_published),
    ] {
        assert!(
            cost <= base * 2,
            "{case}: a claim on a 200,000-row backlog touched {cost} buffers, on 10,000 rows {base}"
        );
    }
}

/// Consumes `topic` until every event id in `expected` arrived, and checks that each key's
/// events arrived (first deliveries) in the order of their `seq`.
async fn receive_in_order(
    kafka: &Kafka,
    topic: &str,
    partitions: i32,
    expected: usize,
    timeout: Duration,
) -> Vec<Received> {
    let mut seen = std::collections::HashSet::new();
    let received = consume(&kafka.bootstrap(), topic, partitions, timeout, |r| {
        if let Some(last) = r.last() {
            seen.insert(last.header("event_id").to_owned());
        }
        seen.len() >= expected
    })
    .await;
    let mut first = std::collections::HashSet::new();
    let mut last_seq: HashMap<&str, u64> = HashMap::new();
    for r in &received {
        if !first.insert(r.header("event_id")) {
            continue;
        }
        let seq = r.payload["seq"].as_u64().unwrap();
        if let Some(prev) = last_seq.insert(&r.key, seq) {
            assert!(
                prev < seq,
                "key {} went out of order: seq {seq} after {prev}",
                r.key
            );
        }
    }
    assert_eq!(first.len(), expected, "every event arrived");
    received
}

/// The first produce request fails for good at the broker (a policy refusal), after the
/// records behind it were sent: none of the key's later records may be counted, or arrive,
/// before the refused ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_refused_at_delivery_is_not_overtaken_by_its_key() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 1).await;
    // One key, one partition.
    let n = emit_events(&db.pool, 1, 300, 300).await;
    kafka.fail_produce_requests(&[RDKafkaRespErr::RD_KAFKA_RESP_ERR_POLICY_VIOLATION]);
    // Kafka refuses the produce requests that follow a refused one (their idempotent sequence
    // numbers no longer follow on); the mock cluster does not check them, so the relay sends
    // a key's records one at a time here, as it would to any broker that does not check.
    let relay = relay_on(&db.pool, &kafka)
        .one_record_in_flight_per_key(true)
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    receive_in_order(&kafka, TOPIC, 1, n, Duration::from_secs(60)).await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    running.stop().await;
}

/// Leadership moves while records are in flight (the broker answers "not leader" once): the
/// producer retries in order; nothing is lost or reordered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_change_in_flight_keeps_order() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 2).await;
    let n = emit_events(&db.pool, 4, 100, 400).await;
    kafka.fail_produce_requests(&[
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
    ]);
    // A produce request pipelined behind the failed one may land first on the mock cluster,
    // which does not check idempotent sequence numbers (Kafka refuses it, and the producer
    // sends it again after the first): as for any broker that does not check, one record of a
    // key in flight at a time.
    let relay = relay_on(&db.pool, &kafka)
        .one_record_in_flight_per_key(true)
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    receive_in_order(&kafka, TOPIC, 2, n, Duration::from_secs(60)).await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    running.stop().await;
}

/// A fatal idempotence error (the broker's sequence numbers disagree with the producer's)
/// makes the producer unusable: the relay replaces it and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_producer_error_is_recovered() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let n = emit_events(&db.pool, 20, 10, 200).await;
    kafka.fail_produce_requests(&[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER]);
    let relay = relay_on(&db.pool, &kafka).build().unwrap();
    let running = Running::relay(&relay);
    let received = consume_all(&kafka, n, Duration::from_secs(60)).await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    check_delivery(&db.pool, &received, n).await;
    running.stop().await;
}

/// A broker error nobody classified is not retried forever: it counts as an attempt, and the
/// record ends parked with its error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_broker_error_counts_as_an_attempt_and_parks() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 1).await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit(&deposit(1, 0)).await.unwrap();
    uow.commit().await.unwrap();
    kafka.fail_produce_requests(&[RDKafkaRespErr::RD_KAFKA_RESP_ERR_INVALID_REQUEST; 20]);
    let relay = relay_on(&db.pool, &kafka).max_attempts(3).build().unwrap();
    let running = Running::relay(&relay);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = relay.status().await.unwrap();
        if status.parked == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "never parked: {status:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (attempts, error): (i32, String) =
        sqlx::query_as("SELECT attempts, last_error FROM outbox_event")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(attempts, 3);
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

/// During a deploy a topic is missing (or the relay may not write to it yet): its records are
/// held, not parked however long it takes, the key's later events wait behind them, even on a
/// topic that exists, and everything flows in order once the topic is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_holds_its_keys_until_it_exists() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    // acct-1: deposit 0, then an audit event (topic missing), then deposits 1 and 2.
    // acct-2: deposits only, on the topic that exists.
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
    let relay = relay_on(&db.pool, &kafka)
        .producer_config(no_auto_create())
        .brokers(kafka.bootstrap())
        .max_attempts(2)
        .build()
        .unwrap();
    let running = Running::relay(&relay);

    // acct-2 flows, acct-1's first deposit too; then its audit event is held.
    let early = consume(
        &kafka.bootstrap(),
        TOPIC,
        PARTITIONS,
        Duration::from_secs(30),
        |r| r.len() >= 4,
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        let status = relay.status().await.unwrap();
        if status.held == 1 {
            break status;
        }
        assert!(Instant::now() < deadline, "never held: {status:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!((status.unpublished, status.parked), (3, 0), "{status:?}");
    // Far more than max_attempts tries later, still held and not parked.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let status = relay.status().await.unwrap();
    assert_eq!(
        (status.unpublished, status.held, status.parked),
        (3, 1, 0),
        "{status:?}"
    );
    let topics = outbox_runtime::admin::status(&db.pool).await.unwrap();
    let audit = topics
        .outbox
        .iter()
        .find(|t| t.topic == "account.audit")
        .unwrap();
    assert_eq!((audit.unpublished, audit.held), (1, 1));
    // Nothing of acct-1 went past its held event.
    let again = consume(
        &kafka.bootstrap(),
        TOPIC,
        PARTITIONS,
        Duration::from_secs(2),
        |_| false,
    )
    .await;
    let acct1: Vec<u64> = again
        .iter()
        .filter(|r| r.key == "acct-1")
        .map(|r| r.payload["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(
        acct1,
        [0],
        "acct-1's later deposits wait for its audit event"
    );
    assert!(early.iter().filter(|r| r.key == "acct-2").count() == 3);

    // The topic appears: the audit event goes out, then the deposits behind it.
    kafka.create_topic("account.audit", 1).await;
    wait_until_published(&db.pool, Duration::from_secs(60)).await;
    let audit = consume(
        &kafka.bootstrap(),
        "account.audit",
        1,
        Duration::from_secs(10),
        |r| !r.is_empty(),
    )
    .await;
    assert_eq!(audit.len(), 1);
    let status = relay.status().await.unwrap();
    assert_eq!((status.held, status.parked), (0, 0));
    running.stop().await;
}

/// A relay whose host vanishes (no FIN, no RST: its traffic is black-holed) loses its shards
/// within the failover timeout (default 20 s, at most 30 s in all), and another relay publishes
/// everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_relay_host_gives_up_its_shards_within_the_failover_timeout() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let proxy = Proxy::start("127.0.0.1:5432".into()).await;
    let behind_proxy = proxy.pool(&db.url, 4).await;
    // Relay A (default failover timeout) owns every shard and publishes.
    let a = Running::relay(&relay_on(&behind_proxy, &kafka).build().unwrap());
    let first = emit_events(&db.pool, 50, 4, 100).await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;

    // A's host vanishes. B starts and events keep coming.
    proxy.black_hole();
    let vanished = Instant::now();
    let b = Running::relay(&relay_on(&db.pool, &kafka).build().unwrap());
    let mut written = first;
    for seq in 4..8 {
        let events: Vec<_> = (0..50).map(|k| deposit(k, seq)).collect();
        let mut uow = Uow::begin(&db.pool).await.unwrap();
        uow.emit_all(&events).await.unwrap();
        uow.commit().await.unwrap();
        written += events.len();
    }
    wait_until_published(&db.pool, Duration::from_secs(40)).await;
    let took = vanished.elapsed();
    println!("relay host vanished: everything published {took:?} later");
    assert!(took <= Duration::from_secs(30), "took {took:?}");
    let received = consume_all(&kafka, written, Duration::from_secs(30)).await;
    check_delivery(&db.pool, &received, written).await;
    a.cancel();
    b.stop().await;
    // A cannot reach its database: it gives up within the failover timeout too.
    tokio::time::timeout(Duration::from_secs(60), a.stop())
        .await
        .expect("the cut-off relay stops");
}

/// Two installations of the outbox in two schemas of one database, one relay each: neither
/// counts the other's relays as its own, so each publishes all of its keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_schemas_in_one_database_do_not_stall_each_other() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let s1 = db.pool_in_schema("s1", 8).await;
    let s2 = db.pool_in_schema("s2", 8).await;
    let relays: Vec<_> = [&s1, &s2]
        .iter()
        .map(|pool| Running::relay(&relay_on(pool, &kafka).build().unwrap()))
        .collect();
    let n1 = emit_events(&s1, 200, 2, 400).await;
    let n2 = emit_events(&s2, 200, 2, 400).await;
    let received = consume_all(&kafka, n1 + n2, Duration::from_secs(60)).await;
    wait_until_published(&s1, Duration::from_secs(30)).await;
    wait_until_published(&s2, Duration::from_secs(30)).await;
    assert_eq!(received.len(), n1 + n2);
    for pool in [&s1, &s2] {
        let members = outbox_runtime::admin::status(pool)
            .await
            .unwrap()
            .relay_instances;
        assert_eq!(members, 1, "each schema counts its own relay only");
    }
    Running::stop_all(relays).await;
}

/// A record parked after repeated refusals, retried by an operator once the cause is gone, is
/// published by the relays already running (whose claims have moved on past it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_parked_record_is_published_by_the_running_relay() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit(&deposit(1, 0)).await.unwrap();
    uow.commit().await.unwrap();
    kafka.fail_produce_requests(&[RDKafkaRespErr::RD_KAFKA_RESP_ERR_POLICY_VIOLATION; 10]);
    let relay = relay_on(&db.pool, &kafka).max_attempts(2).build().unwrap();
    let running = Running::relay(&relay);
    let until = |what: &'static str, done: fn(&relay::RelayStatus) -> bool| {
        let relay = relay.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let status = relay.status().await.unwrap();
                if done(&status) {
                    return;
                }
                assert!(Instant::now() < deadline, "{what}: {status:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    until("parked", |s| s.parked == 1).await;
    kafka.clear_produce_errors();
    // Later events flow: the relay has moved on.
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit(&deposit(2, 0)).await.unwrap();
    uow.commit().await.unwrap();
    until("the next event published", |s| s.unpublished == 0).await;

    let filter = outbox_runtime::admin::PoisonFilter::all();
    let retried = outbox_runtime::admin::retry_parked(&db.pool, &filter)
        .await
        .unwrap();
    assert_eq!(retried, 1);
    until("the retried record published", |s| {
        s.unpublished == 0 && s.parked == 0
    })
    .await;
    let received = consume_all(&kafka, 2, Duration::from_secs(10)).await;
    assert_eq!(received.len(), 2);
    running.stop().await;
}

/// What every batch's first statement reads: the failed rows of its shards that wait for a
/// retry (`begin_sql` in `store/relay.rs`), through the index of rows with a retry time.
async fn retry_scan_buffers(pool: &PgPool) -> i64 {
    let mut conn = pool.acquire().await.unwrap();
    // As on a relay's session: indexes only.
    sqlx::raw_sql("SET enable_seqscan = off; SET enable_bitmapscan = off")
        .execute(&mut *conn)
        .await
        .unwrap();
    let plan: serde_json::Value = sqlx::query_scalar(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) \
         SELECT min(r.id) FILTER (WHERE r.next_attempt_at <= now()), \
                coalesce(bool_or(r.next_attempt_at > now()), false) \
         FROM outbox_event r \
         WHERE r.published_at IS NULL AND r.next_attempt_at IS NOT NULL AND r.parked_at IS NULL",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    buffers(&plan)
}

/// Parked rows pile up until an operator acts, for months maybe; every batch of the relay
/// begins by reading the rows waiting for a retry. A parked row is not one: it leaves that
/// index (its retry time cleared), so the relay's cost does not grow with the parked rows. A
/// retried parked row is due again, and published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_rows_do_not_slow_the_relays_batches() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let empty = retry_scan_buffers(&db.pool).await;
    // 3,000 records too large for the producer: refused at once, parked after one attempt.
    let events: Vec<_> = (0..3_000)
        .map(|i| {
            let mut e = deposit(i, 0);
            e.note = "y".repeat(3_000);
            e
        })
        .collect();
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit_all(&events).await.unwrap();
    uow.commit().await.unwrap();
    let mut config = rdkafka::ClientConfig::new();
    config.set("message.max.bytes", "2000");
    let relay = relay_on(&db.pool, &kafka)
        .producer_config(config)
        .brokers(kafka.bootstrap())
        .max_attempts(1)
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    let deadline = Instant::now() + Duration::from_secs(60);
    while relay.status().await.unwrap().parked < 3_000 {
        assert!(Instant::now() < deadline, "{:?}", relay.status().await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let parked = retry_scan_buffers(&db.pool).await;
    println!("the retry scan's shared buffers: {empty} on an empty outbox, {parked} with 3,000 parked rows");
    assert!(
        parked <= empty + 10,
        "the retry scan reads the parked rows: {parked} buffers, {empty} on an empty outbox"
    );

    // Retried (one, as an operator would after fixing its cause): due again, and published.
    let small = deposit(9, 0);
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit(&small).await.unwrap();
    uow.commit().await.unwrap();
    sqlx::query("UPDATE outbox_event SET payload = jsonb_set(payload, '{note}', '\"fixed\"') WHERE id = (SELECT min(id) FROM outbox_event)")
        .execute(&db.pool)
        .await
        .unwrap();
    let first: i64 = sqlx::query_scalar("SELECT min(id) FROM outbox_event")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let retried = outbox_runtime::admin::retry_parked(
        &db.pool,
        &outbox_runtime::admin::PoisonFilter::all().id(first),
    )
    .await
    .unwrap();
    assert_eq!(retried, 1);
    let received = consume_all(&kafka, 2, Duration::from_secs(30)).await;
    assert_eq!(received.len(), 2, "the retried row and the small one");
    running.stop().await;
}

/// An installation upgraded with rows parked by an earlier version: the migration takes them
/// out of the retry index, and they can still be retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upgrade_takes_parked_rows_out_of_the_retry_index() {
    let db = TestDb::migrated_until("parked_rows_leave_the_retry_index").await;
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key, attempts, last_error, next_attempt_at, \
                                   parked_at) \
         SELECT gen_random_uuid(), 'Account', 'a', 'Deposited', '{}', 'account.events', \
                'acct-' || i, 3, 'refused', now() + interval '1 minute', now() \
         FROM generate_series(1, 10) AS i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    outbox_runtime::migrate::migrate(&db.pool).await.unwrap();
    let in_index: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_event WHERE published_at IS NULL AND next_attempt_at IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(in_index, 0);
    let retried =
        outbox_runtime::admin::retry_parked(&db.pool, &outbox_runtime::admin::PoisonFilter::all())
            .await
            .unwrap();
    assert_eq!(retried, 10);
    let due: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_event WHERE parked_at IS NULL AND next_attempt_at <= now()",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(due, 10);
}

/// The last error of the record `event_id`, once it is parked.
async fn parked_error(pool: &PgPool, relay: &relay::Relay, event_id: uuid::Uuid) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    while relay.status().await.unwrap().parked < 1 {
        assert!(Instant::now() < deadline, "{:?}", relay.status().await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sqlx::query_scalar("SELECT last_error FROM outbox_event WHERE event_id = $1")
        .bind(event_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A record refused as too large is parked with what an operator needs first: its payload's
/// size, and the limit it met: the producer's `message.max.bytes` when the producer refused it
/// before sending; the broker's (whose answer does not say it) when the broker did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_too_large_is_parked_with_its_size_and_the_limit_it_met() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let size = |id: uuid::Uuid| {
        let pool = db.pool.clone();
        async move {
            let bytes: i64 = sqlx::query_scalar(
                "SELECT octet_length(payload::text)::int8 FROM outbox_event WHERE event_id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
            outbox_tests::browser::thousands(bytes)
        }
    };

    // The producer's limit: refused before sending.
    let mut big = deposit(1, 0);
    big.note = "y".repeat(20_000);
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    let id = uow.emit(&big).await.unwrap();
    uow.commit().await.unwrap();
    let mut config = rdkafka::ClientConfig::new();
    config.set("message.max.bytes", "10000");
    let relay = relay_on(&db.pool, &kafka)
        .producer_config(config)
        .brokers(kafka.bootstrap())
        .max_attempts(1)
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    let error = parked_error(&db.pool, &relay, id).await;
    running.stop().await;
    assert!(
        error.starts_with("Message production error: MessageSizeTooLarge"),
        "{error}"
    );
    assert!(
        error.contains(&format!("its payload is {} bytes", size(id).await))
            && error.contains("the producer refused it before sending")
            && error.contains("message.max.bytes = 10000"),
        "{error}"
    );
    sqlx::query("DELETE FROM outbox_event")
        .execute(&db.pool)
        .await
        .unwrap();

    // The broker's limit: refused on delivery, the producer's own setting its default.
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    let id = uow.emit(&deposit(2, 0)).await.unwrap();
    uow.commit().await.unwrap();
    kafka.fail_produce_requests(&[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE; 5]);
    let relay = relay_on(&db.pool, &kafka).max_attempts(1).build().unwrap();
    let running = Running::relay(&relay);
    let error = parked_error(&db.pool, &relay, id).await;
    running.stop().await;
    kafka.clear_produce_errors();
    assert!(
        error.starts_with("Message production error: MessageSizeTooLarge"),
        "{error}"
    );
    assert!(
        error.contains(&format!("its payload is {} bytes", size(id).await))
            && error.contains("the broker refused it")
            && error.contains("message.max.bytes = 1000000 (librdkafka's default)"),
        "{error}"
    );
}
