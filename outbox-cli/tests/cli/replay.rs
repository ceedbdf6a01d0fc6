//! `replay`: filters, dry runs, another topic, events not published yet, an unknown topic.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use outbox_runtime::Uow;
use outbox_tests::kafka::{consume, Kafka};
use outbox_tests::mysql::MySqlTestDb;
use outbox_tests::TestDb;
use uuid::Uuid;

use crate::support::{assert_error, assert_ok, emit_posted, run, stderr, stdout, Closed, TOPIC};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_delivers_every_event_with_its_original_id() {
    replay_case(Kafka::mock(), Outbox::Postgres(TestDb::new().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_delivers_every_event_on_a_broker_process_too() {
    replay_case(Kafka::tansu().await, Outbox::Postgres(TestDb::new().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_delivers_every_event_from_mariadb() {
    replay_case(Kafka::mock(), Outbox::MySql(MySqlTestDb::new().await)).await;
}

/// The database a replay case runs on: the same case, each database's SQL for its setup.
enum Outbox {
    Postgres(TestDb),
    MySql(MySqlTestDb),
}

impl Outbox {
    fn url(&self) -> &str {
        match self {
            Outbox::Postgres(db) => &db.url,
            Outbox::MySql(db) => &db.url,
        }
    }

    /// 1,000 `Posted` events published earlier (the first half 3 hours ago, the rest 30
    /// minutes ago), then 10 `Closed` events not published yet.
    async fn emit(&self) {
        match self {
            Outbox::Postgres(db) => emit_posted(&db.pool, 50, 20).await,
            Outbox::MySql(db) => emit_posted(&db.pool, 50, 20).await,
        };
        let closed: Vec<Closed> = (0..10)
            .map(|l| Closed {
                ledger: format!("l-{l}"),
            })
            .collect();
        match self {
            Outbox::Postgres(db) => {
                let mut uow = Uow::begin(&db.pool).await.unwrap();
                uow.emit_all(&closed).await.unwrap();
                uow.commit().await.unwrap();
                sqlx::query(
                    "UPDATE outbox_event SET published_at = now(), created_at = now() - CASE \
                         WHEN id <= (SELECT min(id) + 499 FROM outbox_event) \
                         THEN interval '3 hours' ELSE interval '30 minutes' END \
                     WHERE event_type = 'Posted'",
                )
                .execute(&db.pool)
                .await
                .unwrap();
            }
            Outbox::MySql(db) => {
                let mut uow = Uow::begin(&db.pool).await.unwrap();
                uow.emit_all(&closed).await.unwrap();
                uow.commit().await.unwrap();
                sqlx::query(
                    "UPDATE outbox_event o JOIN (SELECT MIN(id) + 499 AS m FROM outbox_event) x \
                     SET o.published_at = UTC_TIMESTAMP(6), \
                         o.created_at = UTC_TIMESTAMP(6) \
                             - INTERVAL (CASE WHEN o.id <= x.m THEN 180 ELSE 30 END) MINUTE \
                     WHERE o.event_type = 'Posted'",
                )
                .execute(&db.pool)
                .await
                .unwrap();
            }
        }
    }

    /// The `Posted` rows: id, event id, key.
    async fn posted(&self) -> Vec<(i64, Uuid, String)> {
        match self {
            Outbox::Postgres(db) => sqlx::query_as(
                "SELECT id, event_id, partition_key FROM outbox_event \
                 WHERE event_type = 'Posted'",
            )
            .fetch_all(&db.pool)
            .await
            .unwrap(),
            Outbox::MySql(db) => {
                let rows: Vec<(i64, Vec<u8>, String)> = sqlx::query_as(
                    "SELECT id, event_id, CAST(partition_key AS CHAR) FROM outbox_event \
                     WHERE event_type = 'Posted'",
                )
                .fetch_all(&db.pool)
                .await
                .unwrap();
                rows.into_iter()
                    .map(|(id, e, k)| (id, Uuid::from_slice(&e).unwrap(), k))
                    .collect()
            }
        }
    }
}

async fn replay_case(kafka: Kafka, db: Outbox) {
    kafka.create_topic(TOPIC, 4).await;
    kafka.create_topic("ledger.rebuild", 4).await;
    db.emit().await;
    let bootstrap = kafka.bootstrap();
    let replay = |args: &[&str]| {
        let mut all = vec!["replay", "--topic", TOPIC, "--brokers", bootstrap.as_str()];
        all.extend_from_slice(args);
        let url = db.url().to_owned();
        let all: Vec<String> = all.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = all.iter().map(String::as_str).collect();
            run(&url, &args).await
        }
    };
    let dry_run = |args: &'static [&'static str], expected: &'static str| {
        let out = replay(&[args, &["--dry-run"]].concat());
        async move {
            let out = out.await;
            assert_ok(&out);
            assert!(
                stdout(&out).contains(expected),
                "{args:?}: {}",
                stdout(&out)
            );
        }
    };
    dry_run(&[], "would replay 1000 events").await;
    dry_run(&[], "10 more are not published yet").await;
    dry_run(&["--since", "2h"], "would replay 500 events").await;
    dry_run(&["--until", "1h"], "would replay 500 events").await;
    dry_run(
        &["--since", "4h", "--until", "2h"],
        "would replay 500 events",
    )
    .await;
    dry_run(&["--since", "1h", "--until", "2h"], "would replay 0 events").await;
    dry_run(&["--event-type", "Posted"], "would replay 1000 events").await;
    dry_run(&["--aggregate-type", "Invoice"], "would replay 0 events").await;

    let out = replay(&[
        "--event-type",
        "Posted",
        "--to-topic",
        "ledger.rebuild",
        "--batch-size",
        "300",
    ])
    .await;
    assert_ok(&out);
    assert!(
        stdout(&out).contains("replayed 1000 events"),
        "{}",
        stdout(&out)
    );

    let received = consume(
        &bootstrap,
        "ledger.rebuild",
        4,
        Duration::from_secs(30),
        |r| r.len() >= 1_000,
    )
    .await;
    assert_eq!(received.len(), 1_000);
    let rows = db.posted().await;
    let by_id: HashMap<i64, (Uuid, String)> =
        rows.into_iter().map(|(id, e, k)| (id, (e, k))).collect();
    let mut seen = HashSet::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    for r in &received {
        let id = r.outbox_id();
        let (event_id, key) = &by_id[&id];
        assert_eq!(r.header("event_id"), event_id.to_string());
        assert_eq!(&r.key, key);
        assert!(seen.insert(*event_id), "duplicate {event_id}");
        // Per key, in outbox order (keys map to one partition).
        let prev = last.insert(key.clone(), id);
        assert!(prev.is_none_or(|p| p < id), "key {key} out of order");
    }

    // To another topic, events not published yet would be missing there: an error that says so
    // (after sending the published ones).
    let partial = replay(&["--to-topic", "ledger.rebuild"]).await;
    assert_error(&partial, "10 events of the range were not published yet");
    assert!(
        stdout(&partial).contains("replayed 1000 events"),
        "{}",
        stdout(&partial)
    );
    // To their own topic, the relay sends them: a note, not an error.
    let own = replay(&["--event-type", "Closed"]).await;
    assert_ok(&own);
    assert!(
        stdout(&own).contains("nothing replayed"),
        "{}",
        stdout(&own)
    );
    assert!(
        stdout(&own).contains("10 events of the range are not published yet"),
        "{}",
        stdout(&own)
    );

    let unknown = run(
        db.url(),
        &[
            "replay",
            "--topic",
            "nope.events",
            "--brokers",
            bootstrap.as_str(),
        ],
    )
    .await;
    assert_error(&unknown, "unknown topic `nope.events`");
    assert!(
        stderr(&unknown).contains("ledger.events"),
        "{}",
        stderr(&unknown)
    );
}

/// `outbox replay --nats-url`: the broker-loss drill on JetStream, from the command line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_restores_a_purged_jetstream_stream() {
    let db = TestDb::new().await;
    let server = outbox_tests::nats::NatsServer::start().await;
    server.create_stream("LEDGER", TOPIC, |_| {}).await;
    let total = emit_posted(&db.pool, 5, 4).await;
    let relay = outbox_runtime::relay::Relay::builder(db.pool.clone())
        .jetstream(outbox_runtime::relay::JetStream::new(server.client().await))
        .build()
        .unwrap();
    assert_eq!(relay.publish_pending().await.unwrap(), total as u64);
    let js = server.jetstream().await;
    js.get_stream("LEDGER")
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    let out = run(
        &db.url,
        &["replay", "--nats-url", &server.url(), "--topic", TOPIC],
    )
    .await;
    assert_ok(&out);
    assert!(
        stdout(&out).contains(&format!("replayed {total} events")),
        "{}",
        stdout(&out)
    );
    assert_eq!(server.read_stream("LEDGER").await.len(), total);
}
