//! The relay to NATS JetStream, against real `nats-server` processes (one per test, killed and
//! started again by the fault tests): end to end, several relays with per-key order, a missing
//! stream held and then created, refusals parked without a key being overtaken, the server
//! killed mid-batch, and a resend dropped by the server's duplicate window.

use std::collections::HashMap;
use std::time::Duration;

use outbox_runtime::relay::{JetStream, Relay, RelayBuilder};
use outbox_runtime::Uow;
use outbox_tests::deposits::{check_delivery, deposit, emit_events, wait_until_published, TOPIC};
use outbox_tests::kafka::Received;
use outbox_tests::nats::NatsServer;
use outbox_tests::payments::wait_for;
use outbox_tests::{count, Running, TestDb};
use sqlx::PgPool;

/// The stream the tests create for [`TOPIC`].
const STREAM: &str = "ACCOUNTS";

/// A relay publishing to `server`'s JetStream with its own connection, quick to notice work and
/// to retry.
async fn relay_to(pool: &PgPool, server: &NatsServer) -> RelayBuilder {
    Relay::builder(pool.clone())
        .jetstream(JetStream::new(server.client().await))
        .poll_interval(Duration::from_millis(100))
        .publish_timeout(Duration::from_secs(2))
        .failover_timeout(Duration::from_secs(5))
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(500))
}

async fn server_with_stream() -> NatsServer {
    let server = NatsServer::start().await;
    server.create_stream(STREAM, TOPIC, |_| {}).await;
    server
}

/// Every record's `Nats-Msg-Id` is its event id (what the duplicate window drops resends by).
fn assert_message_ids(received: &[Received]) {
    for r in received {
        assert_eq!(r.header("Nats-Msg-Id"), r.header("event_id"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_on_jetstream() {
    let db = TestDb::new().await;
    let server = server_with_stream().await;
    let relay = relay_to(&db.pool, &server).await.build().unwrap();
    let running = Running::relay(&relay);
    let n = emit_events(&db.pool, 50, 20, 100).await;
    let received = server
        .read_stream_when(STREAM, n as u64, Duration::from_secs(60))
        .await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    let duplicates = check_delivery(&db.pool, &received, n).await;
    assert_eq!(duplicates, 0, "no duplicates without failures");
    assert_message_ids(&received);
    let status = relay.status().await.unwrap();
    assert_eq!((status.unpublished, status.parked), (0, 0));
    assert!(relay.ready().await.is_ok(), "{:?}", relay.ready().await);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_keep_per_key_order_while_writes_continue() {
    let db = TestDb::new().await;
    let server = server_with_stream().await;
    let relays = running_relays(&db.pool, &server, 4, |r| r.batch_size(100)).await;
    // 6,000 events over 300 keys, written while the relays run.
    let mut writers = Vec::new();
    for w in 0..3 {
        let pool = db.pool.clone();
        writers.push(tokio::spawn(async move {
            for seq in 0..20u64 {
                let events: Vec<_> = (0..100).map(|k| deposit(w * 100 + k, seq)).collect();
                let mut uow = Uow::begin(&pool).await.unwrap();
                uow.emit_all(&events).await.unwrap();
                uow.commit().await.unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    let n = 6_000;
    let received = server
        .read_stream_when(STREAM, n as u64, Duration::from_secs(90))
        .await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    let duplicates = check_delivery(&db.pool, &received, n).await;
    assert_eq!(duplicates, 0, "Nats-Msg-Id drops what a relay sent again");
    Running::stop_all(relays).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_without_a_stream_is_held_until_one_is_created() {
    let db = TestDb::new().await;
    let server = NatsServer::start().await;
    let relay = relay_to(&db.pool, &server).await.build().unwrap();
    let running = Running::relay(&relay);
    let n = emit_events(&db.pool, 5, 4, 20).await;
    // Held, as for a missing Kafka topic: not an attempt, never parked, visible in status.
    wait_for(
        "the topic's records to be held",
        Duration::from_secs(30),
        || async { relay.status().await.unwrap().held > 0 },
    )
    .await;
    let error: String =
        sqlx::query_scalar("SELECT last_error FROM outbox_event WHERE held_at IS NOT NULL LIMIT 1")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(
        error.contains("no stream captures the subject `account.events`"),
        "{error}"
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_event WHERE attempts > 0"
        )
        .await,
        0,
        "a held record is not an attempt"
    );
    server.create_stream(STREAM, TOPIC, |_| {}).await;
    let received = server
        .read_stream_when(STREAM, n as u64, Duration::from_secs(60))
        .await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    check_delivery(&db.pool, &received, n).await;
    let status = relay.status().await.unwrap();
    assert_eq!((status.held, status.parked), (0, 0));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_creates_missing_streams_when_told_to() {
    let db = TestDb::new().await;
    let server = NatsServer::start().await;
    let relay = Relay::builder(db.pool.clone())
        .jetstream(JetStream::new(server.client().await).create_streams(true))
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    let n = emit_events(&db.pool, 10, 10, 50).await;
    let received = server
        .read_stream_when("account_events", n as u64, Duration::from_secs(60))
        .await;
    check_delivery(&db.pool, &received, n).await;
    let js = server.jetstream().await;
    let info = js
        .get_stream("account_events")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert_eq!(info.config.subjects, vec![TOPIC.to_owned()]);
    // At least the relay's failover timeout: a resend after a failover is still dropped.
    assert!(info.config.duplicate_window >= Duration::from_secs(40));
    running.stop().await;
}

/// A stream limit with `discard new` refuses what does not fit: each refusal is an attempt,
/// and the record is parked after `max_attempts`, its reason kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_limit_refusal_is_an_attempt_and_parks() {
    let db = TestDb::new().await;
    let server = NatsServer::start().await;
    server
        .create_stream(STREAM, TOPIC, |c| {
            c.max_messages = 5;
            c.discard = async_nats::jetstream::stream::DiscardPolicy::New;
        })
        .await;
    let relay = relay_to(&db.pool, &server)
        .await
        .max_attempts(2)
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    // Eight keys, one event each: five fit.
    emit_events(&db.pool, 8, 1, 8).await;
    wait_for(
        "three rows to be parked",
        Duration::from_secs(30),
        || async {
            let s = relay.status().await.unwrap();
            s.parked == 3 && s.unpublished == 0
        },
    )
    .await;
    let errors: Vec<String> =
        sqlx::query_scalar("SELECT last_error FROM outbox_event WHERE parked_at IS NOT NULL")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    for e in &errors {
        assert!(e.contains("maximum messages exceeded"), "{e}");
    }
    assert_eq!(server.read_stream(STREAM).await.len(), 5);
    running.stop().await;
}

/// A message the stream refuses (over its maximum size) holds its key's later events back
/// while it is retried: nothing of the key goes ahead of it until it is parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_is_not_overtaken_by_its_keys_later_events() {
    let db = TestDb::new().await;
    let server = NatsServer::start().await;
    server
        .create_stream(STREAM, TOPIC, |c| c.max_message_size = 600)
        .await;
    let relay = relay_to(&db.pool, &server)
        .await
        .max_attempts(4)
        .retry_backoff(Duration::from_millis(300), Duration::from_millis(300))
        .build()
        .unwrap();
    // acct-0: seq 0, a big seq 1, then 2 and 3, in one transaction; acct-1 beside it.
    let mut big = deposit(0, 1);
    big.note = "x".repeat(2_000);
    let events = [
        deposit(0, 0),
        deposit(1, 0),
        big,
        deposit(0, 2),
        deposit(1, 1),
        deposit(0, 3),
    ];
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit_all(&events).await.unwrap();
    uow.commit().await.unwrap();
    let running = Running::relay(&relay);
    let big_id: i64 = sqlx::query_scalar(
        "SELECT id FROM outbox_event WHERE payload->>'seq' = '1' AND partition_key = 'acct-0'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    // Refused, and waiting for its next attempt: the key's later events must not be out.
    wait_for(
        "the big event's first refusal",
        Duration::from_secs(30),
        || async {
            count(
                &db.pool,
                &format!("SELECT attempts::int8 FROM outbox_event WHERE id = {big_id}"),
            )
            .await
                >= 1
        },
    )
    .await;
    let early = server.read_stream(STREAM).await;
    let keys: Vec<(String, i64)> = early
        .iter()
        .map(|r| (r.key.clone(), r.outbox_id()))
        .collect();
    assert!(
        !keys.iter().any(|(k, id)| k == "acct-0" && *id > big_id),
        "a later event of acct-0 went ahead of its refused one: {keys:?}"
    );
    assert!(
        keys.iter().any(|(k, _)| k == "acct-1"),
        "the other key is not held up: {keys:?}"
    );
    // Parked after its attempts; then the key's later events go, in order.
    wait_for(
        "the big event to be parked, the rest published",
        Duration::from_secs(30),
        || async {
            let s = relay.status().await.unwrap();
            s.parked == 1 && s.unpublished == 0
        },
    )
    .await;
    let received = server.read_stream(STREAM).await;
    let of_key: Vec<i64> = received
        .iter()
        .filter(|r| r.key == "acct-0")
        .map(Received::outbox_id)
        .collect();
    assert_eq!(of_key.len(), 3);
    assert!(of_key.windows(2).all(|w| w[0] < w[1]), "{of_key:?}");
    assert!(!of_key.contains(&big_id));
    running.stop().await;
}

/// The server killed (SIGKILL) while batches are in flight, and started again: nothing lost,
/// no key out of order, and what was stored but not acknowledged is not stored twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_batch_loses_nothing_and_keeps_order() {
    let db = TestDb::new().await;
    let mut server = server_with_stream().await;
    let relays = running_relays(&db.pool, &server, 2, |r| r.batch_size(50)).await;
    let pool = db.pool.clone();
    let writer = tokio::spawn(async move { emit_events(&pool, 40, 50, 20).await });
    // Kill it once part of the events are out.
    let js = server.jetstream().await;
    wait_for(
        "some events in the stream",
        Duration::from_secs(60),
        || async {
            match js.get_stream(STREAM).await {
                Ok(mut s) => s.info().await.is_ok_and(|i| i.state.messages >= 300),
                Err(_) => false,
            }
        },
    )
    .await;
    server.kill();
    wait_for(
        "a batch to fail while the server is away",
        Duration::from_secs(30),
        || async {
            count(
                &db.pool,
                "SELECT count(*) FROM outbox_event WHERE published_at IS NULL",
            )
            .await
                > 0
        },
    )
    .await;
    server.spawn().await;
    let n = writer.await.unwrap();
    wait_until_published(&db.pool, Duration::from_secs(90)).await;
    let received = server.read_stream(STREAM).await;
    let duplicates = check_delivery(&db.pool, &received, n).await;
    assert_eq!(duplicates, 0, "the duplicate window dropped every resend");
    assert_message_ids(&received);
    Running::stop_all(relays).await;
}

/// Rows published but not marked (a relay killed between the acknowledgement and its commit)
/// are sent again: the server drops them as duplicates, and the rows are marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_within_the_duplicate_window_is_stored_once() {
    let db = TestDb::new().await;
    let server = server_with_stream().await;
    let relay = relay_to(&db.pool, &server).await.build().unwrap();
    let n = emit_events(&db.pool, 10, 5, 50).await;
    assert_eq!(relay.publish_pending().await.unwrap(), n as u64);
    sqlx::query("UPDATE outbox_event SET published_at = NULL")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(relay.publish_pending().await.unwrap(), n as u64);
    let received = server.read_stream(STREAM).await;
    assert_eq!(received.len(), n);
    let mut per_id: HashMap<i64, usize> = HashMap::new();
    for r in &received {
        *per_id.entry(r.outbox_id()).or_default() += 1;
    }
    assert!(per_id.values().all(|c| *c == 1));
    assert_eq!(check_delivery(&db.pool, &received, n).await, 0);
}

/// Headers, CloudEvents attributes (the NATS binding's `ce-` names) and what cannot be sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_events_attributes_travel_as_ce_headers() {
    let db = TestDb::new().await;
    let server = server_with_stream().await;
    let relay = relay_to(&db.pool, &server)
        .await
        .cloud_events(outbox_runtime::relay::CloudEvents::new("/comptes/é"))
        .build()
        .unwrap();
    let n = emit_events(&db.pool, 1, 1, 1).await;
    assert_eq!(relay.publish_pending().await.unwrap(), n as u64);
    let received = server.read_stream(STREAM).await;
    let r = &received[0];
    assert_eq!(r.header("ce-specversion"), "1.0");
    assert_eq!(r.header("ce-id"), r.header("event_id"));
    assert_eq!(r.header("ce-source"), "/comptes/%C3%A9");
    assert_eq!(r.header("ce-type"), "Deposited");
    assert_eq!(r.header("ce-subject"), "acct-0");
    assert!(r.header("ce-time").ends_with('Z'));
}

#[test]
fn build_refuses_both_brokers_and_bad_stream_settings() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let server = NatsServer::start().await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy(&outbox_tests::database_url())
            .unwrap();
        let err = |b: RelayBuilder| b.build().unwrap_err().to_string();
        let js = JetStream::new(server.client().await);
        let both = Relay::builder(pool.clone())
            .brokers("127.0.0.1:9092")
            .jetstream(js.clone());
        assert!(err(both).contains("both Kafka brokers and JetStream"));
        let replicas = Relay::builder(pool.clone()).jetstream(js.clone().stream_replicas(0));
        assert!(err(replicas).contains("stream_replicas"));
        let batch = Relay::builder(pool).jetstream(js).batch_size(0);
        assert!(err(batch).contains("batch_size"));
    });
}

/// The broker-loss drill (R-DIST-OBX-3: the database is the source of truth): the stream is
/// purged as if the broker lost it, and a replay from the outbox restores every event, with its
/// event id, in order per key. Within the stream's duplicate window too: with the event id as
/// its `Nats-Msg-Id`, the server would have acknowledged the replay and stored nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_stream_is_restored_by_a_replay() {
    use outbox_runtime::admin::{Replay, ReplayFilter};
    let db = TestDb::new().await;
    let server = server_with_stream().await;
    let relay = relay_to(&db.pool, &server).await.build().unwrap();
    let n = emit_events(&db.pool, 20, 10, 100).await;
    assert_eq!(relay.publish_pending().await.unwrap(), n as u64);
    let js = server.jetstream().await;
    let purged = js.get_stream(STREAM).await.unwrap().purge().await.unwrap();
    assert_eq!(purged.purged, n as u64);
    assert!(server.read_stream(STREAM).await.is_empty());

    let replay = Replay::jetstream(db.pool.clone(), JetStream::new(server.client().await)).unwrap();
    let done = replay
        .run(&ReplayFilter::topic(TOPIC), None, |_| {})
        .await
        .unwrap();
    assert_eq!((done.published, done.unpublished), (n as u64, 0));
    let received = server.read_stream(STREAM).await;
    assert_eq!(received.len(), n, "every event is back in the stream");
    let ids: Vec<(uuid::Uuid, String)> =
        sqlx::query_as("SELECT event_id, partition_key FROM outbox_event ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    // The stream's order is the outbox's, key by key (a batch sends each key's run together, so
    // keys interleave differently).
    let per_key = |pairs: Vec<(String, String)>| {
        let mut keys: HashMap<String, Vec<String>> = HashMap::new();
        for (event, key) in pairs {
            keys.entry(key).or_default().push(event);
        }
        keys
    };
    let got = per_key(
        received
            .iter()
            .map(|r| (r.header("event_id").to_owned(), r.key.clone()))
            .collect(),
    );
    let want = per_key(
        ids.iter()
            .map(|(e, k)| (e.to_string(), k.clone()))
            .collect(),
    );
    assert_eq!(got, want);
    for r in &received {
        assert!(r
            .header("Nats-Msg-Id")
            .starts_with(&format!("{}:replay:", r.header("event_id"))));
    }
}

/// A stream deleted under a running relay that creates streams: the next publish finds none,
/// the relay creates it again, and what was emitted after the deletion arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_deleted_under_the_relay_is_created_again() {
    let db = TestDb::new().await;
    let server = NatsServer::start().await;
    let relay = Relay::builder(db.pool.clone())
        .jetstream(JetStream::new(server.client().await).create_streams(true))
        .poll_interval(Duration::from_millis(100))
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    let first = emit_events(&db.pool, 5, 2, 10).await;
    server
        .read_stream_when("account_events", first as u64, Duration::from_secs(30))
        .await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    let js = server.jetstream().await;
    js.delete_stream("account_events").await.unwrap();
    let events: Vec<_> = (0..5).map(|k| deposit(k, 100)).collect();
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit_all(&events).await.unwrap();
    uow.commit().await.unwrap();
    let received = server
        .read_stream_when("account_events", 5, Duration::from_secs(30))
        .await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    let seqs: Vec<u64> = received
        .iter()
        .map(|r| r.payload["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, vec![100; 5], "the events emitted after the deletion");
    assert_eq!(relay.status().await.unwrap().parked, 0);
    running.stop().await;
}

/// `keys` hot keys with `per_key` events each, written in units of work of 100 before any relay
/// runs (so that every batch holds a run of each key); an event for which `big(key, seq)` holds
/// carries a 2,000-byte note. Returns how many were written.
async fn emit_hot_keys(
    pool: &PgPool,
    keys: usize,
    per_key: u64,
    big: impl Fn(usize, u64) -> bool,
) -> usize {
    let events: Vec<_> = (0..per_key)
        .flat_map(|seq| (0..keys).map(move |k| (k, seq)))
        .map(|(k, seq)| {
            let mut event = deposit(k, seq);
            if big(k, seq) {
                event.note = "x".repeat(2_000);
            }
            event
        })
        .collect();
    for chunk in events.chunks(100) {
        let mut uow = Uow::begin(pool).await.unwrap();
        uow.emit_all(chunk).await.unwrap();
        uow.commit().await.unwrap();
    }
    events.len()
}

/// Changes the settings of `server`'s stream [`STREAM`].
async fn update_stream(
    server: &NatsServer,
    tweak: impl FnOnce(&mut async_nats::jetstream::stream::Config),
) {
    let js = server.jetstream().await;
    let mut config = js
        .get_stream(STREAM)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    tweak(&mut config);
    js.update_stream(config).await.unwrap();
}

/// `count` relays to `server`, each with a connection of its own, retrying refusals at once and
/// never parking.
async fn persistent_relays(pool: &PgPool, server: &NatsServer, count: usize) -> Vec<Running> {
    running_relays(pool, server, count, |r| {
        r.max_attempts(1_000_000)
            .retry_backoff(Duration::from_millis(20), Duration::from_millis(100))
    })
    .await
}

/// `count` relays to `server` ([`relay_to`], then `tweak`), each with a connection of its
/// own, running.
async fn running_relays(
    pool: &PgPool,
    server: &NatsServer,
    count: usize,
    tweak: impl Fn(RelayBuilder) -> RelayBuilder,
) -> Vec<Running> {
    let mut relays = Vec::new();
    for _ in 0..count {
        let relay = tweak(relay_to(pool, server).await).build().unwrap();
        relays.push(Running::relay(&relay));
    }
    relays
}

async fn attempts_made(pool: &PgPool) -> i64 {
    count(pool, "SELECT count(*) FROM outbox_event WHERE attempts > 0").await
}

/// Hot keys, several relays, and messages in the middle of their keys' runs refused (over the
/// stream's maximum size) while the key's later messages are in flight behind them: nothing of
/// a key is stored ahead of its refused message, which goes once the limit is lifted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_keys_keep_their_order_when_a_message_is_refused_mid_pipeline() {
    let db = TestDb::new().await;
    let server = NatsServer::start().await;
    server
        .create_stream(STREAM, TOPIC, |c| c.max_message_size = 600)
        .await;
    let big = |k: usize, seq: u64| (seq == 7 && k.is_multiple_of(2)) || (seq == 23 && k == 3);
    let n = emit_hot_keys(&db.pool, 10, 40, big).await;
    let relays = persistent_relays(&db.pool, &server, 2).await;
    wait_for("a big message refused", Duration::from_secs(30), || async {
        attempts_made(&db.pool).await > 0
    })
    .await;
    // Whatever of their keys could have gone past them has had its chance: let them in.
    update_stream(&server, |c| c.max_message_size = -1).await;
    wait_until_published(&db.pool, Duration::from_secs(60)).await;
    let received = server.read_stream(STREAM).await;
    assert_eq!(check_delivery(&db.pool, &received, n).await, 0);
    Running::stop_all(relays).await;
}

/// Hot keys, several relays, a work-queue stream with `discard new` that is full most of the
/// time: each refusal (maximum messages exceeded) comes with later messages of the key already
/// sent behind it, and room is made only as a reader takes messages. None is lost, none stored
/// ahead of an earlier one of its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_keys_keep_their_order_while_a_full_stream_refuses_them() {
    use async_nats::jetstream::stream::{DiscardPolicy, RetentionPolicy};
    let db = TestDb::new().await;
    let server = NatsServer::start().await;
    server
        .create_stream(STREAM, TOPIC, |c| {
            c.retention = RetentionPolicy::WorkQueue;
            c.max_messages = 30;
            c.discard = DiscardPolicy::New;
        })
        .await;
    let n = emit_hot_keys(&db.pool, 10, 100, |_, _| false).await;
    let relays = persistent_relays(&db.pool, &server, 2).await;
    wait_for(
        "the full stream to refuse",
        Duration::from_secs(30),
        || async { attempts_made(&db.pool).await > 0 },
    )
    .await;
    let taken = server
        .take_from_stream(STREAM, "reader", n, Duration::from_secs(120))
        .await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    assert_eq!(check_delivery(&db.pool, &taken, n).await, 0);
    Running::stop_all(relays).await;
}

/// Hot keys, several relays, and the subject taken out of the stream and put back again and
/// again while they publish: what finds no stream is held, and nothing of its key is stored
/// ahead of it once the subject maps to the stream again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_keys_keep_their_order_while_their_subject_leaves_the_stream() {
    let db = TestDb::new().await;
    let server = server_with_stream().await;
    let n = emit_hot_keys(&db.pool, 10, 100, |_, _| false).await;
    let relays = persistent_relays(&db.pool, &server, 2).await;
    let js = server.jetstream().await;
    let stored = || async {
        match js.get_stream(STREAM).await {
            Ok(mut s) => s.info().await.map_or(0, |i| i.state.messages),
            Err(_) => 0,
        }
    };
    let mut before = 0;
    for _ in 0..6 {
        wait_for("more messages stored", Duration::from_secs(60), || async {
            let now = stored().await;
            now >= before + 50 || now >= n as u64
        })
        .await;
        if stored().await >= n as u64 {
            break;
        }
        update_stream(&server, |c| c.subjects = vec!["elsewhere".to_owned()]).await;
        // A message held; unless the relays stored the last ones between the count above and
        // the update (nothing left to hold).
        wait_for("a message held", Duration::from_secs(30), || async {
            held(&db.pool).await > 0
                || count(
                    &db.pool,
                    "SELECT count(*) FROM outbox_event WHERE published_at IS NULL",
                )
                .await
                    == 0
        })
        .await;
        update_stream(&server, |c| c.subjects = vec![TOPIC.to_owned()]).await;
        before = stored().await;
    }
    wait_until_published(&db.pool, Duration::from_secs(90)).await;
    let received = server.read_stream(STREAM).await;
    assert_eq!(check_delivery(&db.pool, &received, n).await, 0);
    Running::stop_all(relays).await;
}

async fn held(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM outbox_event WHERE held_at IS NOT NULL",
    )
    .await
}

/// Hot keys, three relays, events written all along, and the server killed (SIGKILL) twice with
/// batches in flight and started again: nothing lost, no key out of order, nothing stored twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_keys_keep_their_order_across_server_restarts() {
    let db = TestDb::new().await;
    let mut server = server_with_stream().await;
    let relays = running_relays(&db.pool, &server, 3, |r| r.batch_size(200)).await;
    let pool = db.pool.clone();
    let writer = tokio::spawn(async move { emit_events(&pool, 10, 400, 50).await });
    for stored in [500, 2_000] {
        let js = server.jetstream().await;
        wait_for("events in the stream", Duration::from_secs(60), || async {
            match js.get_stream(STREAM).await {
                Ok(mut s) => s.info().await.is_ok_and(|i| i.state.messages >= stored),
                Err(_) => false,
            }
        })
        .await;
        server.kill();
        server.spawn().await;
    }
    let n = writer.await.unwrap();
    wait_until_published(&db.pool, Duration::from_secs(90)).await;
    let received = server.read_stream(STREAM).await;
    let duplicates = check_delivery(&db.pool, &received, n).await;
    assert_eq!(duplicates, 0, "the duplicate window dropped every resend");
    Running::stop_all(relays).await;
}
