//! The `outbox` binary against real PostgreSQL and Kafka (the mock cluster): every command, its
//! effects checked in the database and on the broker, and its errors.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use outbox_runtime::inbox::{Consumer, Mode};
use outbox_runtime::relay::Relay;
use outbox_runtime::{OutboxEvent, Uow};
use outbox_tests::fixtures::{create_orders, insert_orders, mark_order_paid, PaymentSucceeded};
use outbox_tests::kafka::{consume, Kafka};
use outbox_tests::{ChildGuard, TestDb};
use serde::Serialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const TOPIC: &str = "ledger.events";

#[derive(Serialize, OutboxEvent)]
#[outbox(
    topic = "ledger.events",
    aggregate_type = "Ledger",
    event_type = "Posted"
)]
struct Posted {
    #[outbox(aggregate_id)]
    ledger: String,
    seq: u32,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(
    topic = "ledger.events",
    aggregate_type = "Ledger",
    event_type = "Closed"
)]
struct Closed {
    #[outbox(aggregate_id)]
    ledger: String,
}

/// The binary, with no inherited configuration and nothing on stdin.
fn outbox(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("KAFKA_BROKERS")
        .stdin(Stdio::null());
    cmd
}

/// Runs the binary with `DATABASE_URL` = `url` off the test's runtime thread.
async fn run(url: &str, args: &[&str]) -> Output {
    let mut cmd = outbox(args);
    cmd.env("DATABASE_URL", url);
    tokio::task::spawn_blocking(move || cmd.output().expect("run outbox"))
        .await
        .expect("join")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[track_caller]
fn assert_ok(o: &Output) {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        stdout(o),
        stderr(o)
    );
}

/// A failed run: exit code 1 and exactly one line on stderr, containing `expected`.
#[track_caller]
fn assert_error(o: &Output, expected: &str) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(1),
        "stdout: {}\nstderr: {err}",
        stdout(o)
    );
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains(expected), "expected `{expected}` in: {err}");
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn emit_posted(pool: &PgPool, ledgers: usize, per_ledger: u32) -> usize {
    let events: Vec<Posted> = (0..per_ledger)
        .flat_map(|seq| {
            (0..ledgers).map(move |l| Posted {
                ledger: format!("l-{l}"),
                seq,
            })
        })
        .collect();
    for chunk in events.chunks(250) {
        let mut uow = Uow::begin(pool).await.unwrap();
        uow.emit_all(chunk).await.unwrap();
        uow.commit().await.unwrap();
    }
    events.len()
}

/// Outbox rows inserted by hand: `n` rows of `topic`, created `created_ago` and published
/// `published_ago` (`NULL` = unpublished), parked or not. Returns their ids.
async fn insert_rows(
    pool: &PgPool,
    topic: &str,
    n: i64,
    created_ago: &str,
    published_ago: Option<&str>,
    parked: bool,
) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
             topic, partition_key, created_at, published_at, parked_at, attempts, last_error) \
         SELECT gen_random_uuid(), 'Ledger', 'l-' || i, 'Posted', jsonb_build_object('seq', i), \
             $1, 'l-' || i, now() - $2::interval, now() - $3::interval, \
             CASE WHEN $4 THEN now() END, CASE WHEN $4 THEN 5 ELSE 0 END, \
             CASE WHEN $4 THEN 'Broker: Message size too large' END \
         FROM generate_series(1, $5) AS i RETURNING id",
    )
    .bind(topic)
    .bind(created_ago)
    .bind(published_ago)
    .bind(parked)
    .bind(n)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_then_status_matches_a_hand_count() {
    let db = TestDb::empty().await;
    assert_error(&run(&db.url, &["status"]).await, "run `outbox migrate`");
    let first = run(&db.url, &["migrate"]).await;
    assert_ok(&first);
    let applied = outbox_runtime::migrate::MIGRATIONS.len();
    assert!(
        stdout(&first).contains(&format!("applied {applied} migrations")),
        "{}",
        stdout(&first)
    );
    let again = run(&db.url, &["migrate"]).await;
    assert_ok(&again);
    assert!(
        stdout(&again).contains("schema up to date"),
        "{}",
        stdout(&again)
    );

    let pool = &db.pool;
    insert_rows(pool, "a.events", 3, "1 hour", None, false).await;
    insert_rows(pool, "a.events", 1, "2 hours", None, true).await;
    insert_rows(pool, "a.events", 2, "1 minute", Some("10 seconds"), false).await;
    insert_rows(pool, "a.events", 5, "3 hours", Some("2 hours"), false).await;
    insert_rows(pool, "b.events", 2, "5 minutes", None, false).await;
    sqlx::query(
        "UPDATE outbox_event SET attempts = 1, next_attempt_at = now() + interval '1 hour' \
         WHERE id = (SELECT min(id) FROM outbox_event WHERE topic = 'b.events')",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO inbox_event (event_id, topic, event_type, payload, processed, processed_at, \
             dead_at, next_attempt_at, received_at) \
         SELECT gen_random_uuid(), 'x.events', 'E', '{}', i > 5, CASE WHEN i > 5 THEN now() END, \
             CASE WHEN i = 5 THEN now() END, CASE WHEN i = 4 THEN now() END, \
             now() - make_interval(mins => i) \
         FROM generate_series(1, 7) AS i",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO processed_event (event_id, handler) \
         SELECT gen_random_uuid(), 'h' FROM generate_series(1, 9)",
    )
    .execute(pool)
    .await
    .unwrap();

    let out = run(&db.url, &["status", "--json"]).await;
    assert_ok(&out);
    let status: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let topic = |name: &str| {
        status["outbox"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["topic"] == name)
            .unwrap_or_else(|| panic!("{name} in {status}"))
            .clone()
    };
    let a = topic("a.events");
    assert_eq!(
        (
            &a["unpublished"],
            &a["retrying"],
            &a["parked"],
            &a["published_last_minute"]
        ),
        (&3.into(), &0.into(), &1.into(), &2.into())
    );
    let age = a["oldest_unpublished_age_secs"].as_f64().unwrap();
    assert!((3_600.0..3_700.0).contains(&age), "{age}");
    let b = topic("b.events");
    assert_eq!(
        (
            &b["unpublished"],
            &b["retrying"],
            &b["parked"],
            &b["published_last_minute"]
        ),
        (&2.into(), &1.into(), &0.into(), &0.into())
    );
    assert_eq!(status["outbox"].as_array().unwrap().len(), 2);
    let inbox = &status["inbox"][0];
    assert_eq!(inbox["topic"], "x.events");
    assert_eq!(
        (&inbox["unprocessed"], &inbox["retrying"], &inbox["dead"]),
        (&4.into(), &1.into(), &1.into())
    );
    // The oldest live unprocessed row is 4 minutes old (row 5, 5 minutes, is dead).
    let age = inbox["oldest_unprocessed_age_secs"].as_f64().unwrap();
    assert!((240.0..300.0).contains(&age), "{age}");
    assert_eq!(status["processed_event_rows"], 9);
    assert_eq!(status["relay_instances"], 0);

    let table = run(&db.url, &["status"]).await;
    assert_ok(&table);
    let text = stdout(&table);
    let line = text.lines().find(|l| l.starts_with("a.events")).unwrap();
    let cells: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(cells[1..5], ["3", "0", "0", "1"], "{text}");
    assert!(cells[5].starts_with("1h00m"), "{text}");
    assert_eq!(cells[6], "2", "{text}");
    assert!(text.contains("processed_event rows: 9"), "{text}");

    // As a health check: the oldest waiting row is an hour old.
    let unhealthy = run(&db.url, &["status", "--max-age", "30m"]).await;
    assert_error(
        &unhealthy,
        "the oldest unpublished outbox row of `a.events` is 1h00m old, more than 30m00s",
    );
    assert!(
        stdout(&unhealthy).contains("a.events"),
        "the figures are printed too"
    );
    assert_ok(&run(&db.url, &["status", "--max-age", "2h", "--json"]).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_delivers_every_event_with_its_original_id() {
    replay_case(Kafka::mock()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_delivers_every_event_on_a_broker_process_too() {
    replay_case(Kafka::tansu().await).await;
}

async fn replay_case(kafka: Kafka) {
    let db = TestDb::new().await;
    kafka.create_topic(TOPIC, 4).await;
    kafka.create_topic("ledger.rebuild", 4).await;
    emit_posted(&db.pool, 50, 20).await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    for l in 0..10 {
        uow.emit(&Closed {
            ledger: format!("l-{l}"),
        })
        .await
        .unwrap();
    }
    uow.commit().await.unwrap();
    // Posted events were published earlier (the first half 3 hours ago, the rest 30 minutes
    // ago); the 10 Closed events are not published yet.
    sqlx::query(
        "UPDATE outbox_event SET published_at = now(), created_at = now() - CASE \
             WHEN id <= (SELECT min(id) + 499 FROM outbox_event) THEN interval '3 hours' \
             ELSE interval '30 minutes' END \
         WHERE event_type = 'Posted'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let bootstrap = kafka.bootstrap();
    let replay = |args: &[&str]| {
        let mut all = vec!["replay", "--topic", TOPIC, "--brokers", bootstrap.as_str()];
        all.extend_from_slice(args);
        let url = db.url.clone();
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
    let rows: Vec<(i64, Uuid, String)> = sqlx::query_as(
        "SELECT id, event_id, partition_key FROM outbox_event WHERE event_type = 'Posted'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
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
        &db.url,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_removes_exactly_the_rows_past_the_cutoff_while_a_relay_publishes() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let old_published = insert_rows(pool, TOPIC, 500, "41 days", Some("40 days"), false).await;
    insert_rows(pool, TOPIC, 100, "11 days", Some("10 days"), false).await;
    insert_rows(pool, TOPIC, 20, "60 days", None, true).await;
    // Old but unpublished: the relay publishes them now, so they are young published rows.
    insert_rows(pool, TOPIC, 30, "60 days", None, false).await;
    sqlx::query(
        "INSERT INTO inbox_event (event_id, topic, event_type, payload, processed, processed_at, \
             dead_at, received_at) \
         SELECT gen_random_uuid(), 't', 'E', '{}', i <= 30, \
             CASE WHEN i <= 30 THEN now() - interval '40 days' END, \
             CASE WHEN i > 40 THEN now() - interval '40 days' END, now() - interval '41 days' \
         FROM generate_series(1, 45) AS i",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO processed_event (event_id, handler, processed_at) \
         SELECT gen_random_uuid(), 'h', now() - make_interval(days => CASE WHEN i <= 40 THEN 31 ELSE 29 END) \
         FROM generate_series(1, 55) AS i",
    )
    .execute(pool)
    .await
    .unwrap();
    let before: HashSet<i64> = sqlx::query_scalar("SELECT id FROM outbox_event")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect();

    let dry = run(&db.url, &["cleanup", "--older-than", "30d", "--dry-run"]).await;
    assert_ok(&dry);
    let text = stdout(&dry);
    for expected in [
        "would delete 570 rows",
        "500 from outbox_event (before ",
        "30 from inbox_event (before ",
        "40 from processed_event (before ",
    ] {
        assert!(text.contains(expected), "{expected}: {text}");
    }
    // A longer retention for the dedup records: 35 days keeps the 31-day-old processed_event
    // rows, not the 40-day-old inbox rows.
    let dedup = run(
        &db.url,
        &[
            "cleanup",
            "--older-than",
            "30d",
            "--dedup-older-than",
            "35d",
            "--dry-run",
        ],
    )
    .await;
    assert_ok(&dedup);
    let text = stdout(&dedup);
    for expected in [
        "would delete 530 rows",
        "500 from outbox_event",
        "30 from inbox_event",
        "0 from processed_event",
    ] {
        assert!(text.contains(expected), "{expected}: {text}");
    }
    let refused = run(&db.url, &["cleanup", "--older-than", "30d"]).await;
    assert_error(&refused, "pass --yes");
    assert_eq!(
        count(pool, "SELECT count(*) FROM outbox_event").await,
        before.len() as i64
    );

    // A relay publishes while new events keep coming, and the cleanup runs.
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 4).await;
    let relay = Relay::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .poll_interval(Duration::from_millis(50))
        .build()
        .unwrap();
    let cancel = CancellationToken::new();
    let relay_task = relay.spawn(cancel.clone());
    let writer = {
        let pool = db.pool.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let mut n = 0;
            while !cancel.is_cancelled() && n < 3_000 {
                n += emit_posted(&pool, 20, 5).await;
            }
            n
        })
    };
    let out = run(
        &db.url,
        &["cleanup", "--older-than", "30d", "--batch", "37", "--yes"],
    )
    .await;
    assert_ok(&out);
    let text = stdout(&out);
    assert!(text.contains("outbox_event: deleted 500 rows"), "{text}");
    assert!(text.contains("inbox_event: deleted 30 rows"), "{text}");
    assert!(text.contains("processed_event: deleted 40 rows"), "{text}");
    let written = writer.await.unwrap();
    // Everything left gets published, then the relay stops.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(
        pool,
        "SELECT count(*) FROM outbox_event WHERE published_at IS NULL AND parked_at IS NULL",
    )
    .await
        > 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "relay did not drain"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cancel.cancel();
    relay_task.await.unwrap().unwrap();

    let after: HashSet<i64> = sqlx::query_scalar("SELECT id FROM outbox_event")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    let removed: HashSet<i64> = before.difference(&after).copied().collect();
    assert_eq!(removed, old_published.into_iter().collect::<HashSet<_>>());
    assert_eq!(after.len(), before.len() - 500 + written);
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM outbox_event WHERE parked_at IS NOT NULL"
        )
        .await,
        20
    );
    assert_eq!(
        count(pool, "SELECT count(*) FROM inbox_event WHERE processed").await,
        0
    );
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM inbox_event WHERE dead_at IS NOT NULL"
        )
        .await,
        5
    );
    assert_eq!(count(pool, "SELECT count(*) FROM inbox_event").await, 15);
    assert_eq!(
        count(pool, "SELECT count(*) FROM processed_event").await,
        15
    );

    let nothing = run(&db.url, &["cleanup", "--older-than", "30d", "--yes"]).await;
    assert_ok(&nothing);
    assert!(
        stdout(&nothing).contains("nothing deleted"),
        "{}",
        stdout(&nothing)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_events_are_listed_retried_and_dropped() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 2).await;
    kafka.create_topic("other.events", 2).await;
    let ours = insert_rows(pool, TOPIC, 2, "1 hour", None, true).await;
    let other = insert_rows(pool, "other.events", 1, "1 hour", None, true).await;

    let list = run(&db.url, &["parked", "list"]).await;
    assert_ok(&list);
    let text = stdout(&list);
    assert_eq!(
        text.lines()
            .filter(|l| l.contains("Message size too large"))
            .count(),
        3,
        "{text}"
    );
    let json = run(&db.url, &["parked", "list", "--topic", TOPIC, "--json"]).await;
    assert_ok(&json);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&stdout(&json)).unwrap();
    let ids: Vec<i64> = rows.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(ids, ours);
    assert_eq!(rows[0]["attempts"], 5);
    assert_eq!(rows[0]["payload"]["seq"], 1);

    assert_error(&run(&db.url, &["parked", "retry"]).await, "say which rows");
    assert_error(
        &run(&db.url, &["parked", "retry", "--topic", TOPIC]).await,
        "pass --yes",
    );
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM outbox_event WHERE parked_at IS NOT NULL"
        )
        .await,
        3
    );

    let retry = run(&db.url, &["parked", "retry", "--topic", TOPIC, "--yes"]).await;
    assert_ok(&retry);
    assert!(
        stdout(&retry).contains("un-parked 2 events"),
        "{}",
        stdout(&retry)
    );
    let reset: i64 = count(
        pool,
        "SELECT count(*) FROM outbox_event WHERE parked_at IS NULL AND attempts = 0 \
         AND next_attempt_at <= now() AND published_at IS NULL",
    )
    .await;
    assert_eq!(reset, 2);
    // The relay publishes the retried rows, and not the one still parked.
    let relay = Relay::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .build()
        .unwrap();
    assert_eq!(relay.publish_pending().await.unwrap(), 2);
    let published: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM outbox_event WHERE published_at IS NOT NULL ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(published, ours);

    let event_id: Uuid = sqlx::query_scalar("SELECT event_id FROM outbox_event WHERE id = $1")
        .bind(other[0])
        .fetch_one(pool)
        .await
        .unwrap();
    assert_error(
        &run(&db.url, &["parked", "drop", "--id", "x1", "--yes"]).await,
        "invalid --id `x1`",
    );
    let dropped = run(
        &db.url,
        &["parked", "drop", "--id", &event_id.to_string(), "--yes"],
    )
    .await;
    assert_ok(&dropped);
    assert!(
        stdout(&dropped).contains("dropped 1 parked events"),
        "{}",
        stdout(&dropped)
    );
    assert_eq!(count(pool, "SELECT count(*) FROM outbox_event").await, 2);
    let empty = run(&db.url, &["parked", "drop", "--all", "--yes"]).await;
    assert_ok(&empty);
    assert!(
        stdout(&empty).contains("nothing changed"),
        "{}",
        stdout(&empty)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_inbox_rows_are_listed_and_retried() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    create_orders(pool).await;
    let orders: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
    insert_orders(pool, &orders).await;
    for order_id in &orders {
        let event = PaymentSucceeded {
            payment_id: Uuid::now_v7(),
            order_id: *order_id,
            amount: 100,
        };
        sqlx::query(
            "INSERT INTO inbox_event (event_id, topic, event_type, partition_key, payload, \
                 attempts, last_error, dead_at) \
             VALUES ($1, $2, $3, $4, $5, 5, 'handler `mark_order_paid` failed: deadlock', now())",
        )
        .bind(Uuid::new_v4())
        .bind(PaymentSucceeded::TOPIC)
        .bind(PaymentSucceeded::EVENT_TYPE)
        .bind(event.partition_key())
        .bind(serde_json::to_value(&event).unwrap())
        .execute(pool)
        .await
        .unwrap();
    }
    let list = run(&db.url, &["inbox", "dead", "list", "--limit", "2"]).await;
    assert_ok(&list);
    let text = stdout(&list);
    assert_eq!(
        text.lines().filter(|l| l.contains("deadlock")).count(),
        2,
        "{text}"
    );
    assert!(text.contains("there may be more"), "{text}");
    assert_error(
        &run(&db.url, &["inbox", "dead", "retry", "--id", "7", "--yes"]).await,
        "expected an event id (UUID)",
    );

    let retry = run(&db.url, &["inbox", "dead", "retry", "--all", "--yes"]).await;
    assert_ok(&retry);
    assert!(
        stdout(&retry).contains("revived 3 dead inbox rows"),
        "{}",
        stdout(&retry)
    );
    // The inbox processor handles them now.
    let kafka = Kafka::mock();
    let consumer = Consumer::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .group_id("cli-test")
        .handler(mark_order_paid)
        .mode(Mode::Inbox)
        .build()
        .unwrap();
    assert_eq!(consumer.process_inbox_pending().await.unwrap(), 3);
    assert_eq!(
        count(pool, "SELECT count(*) FROM orders WHERE paid = 1").await,
        3
    );
    assert_eq!(
        count(pool, "SELECT count(*) FROM inbox_event WHERE processed").await,
        3
    );
}

/// Reads the child's stdout lines until one contains `needle`; returns it.
fn wait_line(reader: &mut impl BufRead, needle: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = reader.read_line(&mut line).expect("read child stdout");
        assert!(n > 0, "the process ended before printing `{needle}`");
        if line.contains(needle) {
            return line;
        }
    }
}

fn signal(child: &ChildGuard, name: &str) {
    let status = Command::new("kill")
        .args([name, &child.0.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
}

/// Waits (at most `timeout`) for the child to exit; returns its exit code.
async fn wait_exit(child: &mut ChildGuard, timeout: Duration) -> Option<i32> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(status) = child.0.try_wait().expect("try_wait") {
            return status.code();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the process did not exit in {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_command_runs_several_instances_and_stops_on_sigterm() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 4).await;
    let mut cmd = outbox(&["relay", "--instances", "3", "--poll-interval", "100ms"]);
    cmd.env("DATABASE_URL", &db.url)
        .env("KAFKA_BROKERS", kafka.bootstrap())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = ChildGuard(cmd.spawn().expect("start relay"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let started = tokio::task::spawn_blocking(move || {
        let line = wait_line(&mut out, "outbox relay:");
        (line, out)
    });
    let (line, mut out) = started.await.unwrap();
    assert!(line.contains("3 instance(s)"), "{line}");

    let total = emit_posted(&db.pool, 30, 10).await;
    let received = consume(&kafka.bootstrap(), TOPIC, 4, Duration::from_secs(30), |r| {
        r.len() >= total
    })
    .await;
    assert_eq!(received.len(), total);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = run(&db.url, &["status", "--json"]).await;
        let status: serde_json::Value = serde_json::from_str(&stdout(&status)).unwrap();
        if status["relay_instances"] == 3 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "3 relay instances: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_event WHERE published_at IS NULL"
        )
        .await,
        0
    );

    signal(&child, "-TERM");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(20)).await,
        Some(0)
    );
    let rest = tokio::task::spawn_blocking(move || wait_line(&mut out, "stopped"))
        .await
        .unwrap();
    assert!(rest.contains("0 unpublished"), "{rest}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_broker_serves_kafka_on_a_fixed_port() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cmd = outbox(&[
        "dev-broker",
        "--port",
        &port.to_string(),
        "--partitions",
        "3",
        "--topic",
        "demo.events",
    ]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = ChildGuard(cmd.spawn().expect("start dev broker"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let (line, _out) =
        tokio::task::spawn_blocking(move || (wait_line(&mut out, "listening on"), out))
            .await
            .unwrap();
    let bootstrap = format!("127.0.0.1:{port}");
    assert!(line.contains(&bootstrap), "{line}");

    // A relay publishes through it, and a reader gets the events back.
    let db = TestDb::new().await;
    emit_posted(&db.pool, 3, 4).await;
    let relay = Relay::builder(db.pool.clone())
        .brokers(&bootstrap)
        .build()
        .unwrap();
    assert_eq!(relay.publish_pending().await.unwrap(), 12);
    let received = consume(&bootstrap, TOPIC, 4, Duration::from_secs(30), |r| {
        r.len() >= 12
    })
    .await;
    assert_eq!(received.len(), 12);
    // The topic created at start has the asked partitions; the broker advertises the port.
    let metadata = tokio::task::spawn_blocking(move || {
        let client: rdkafka::producer::BaseProducer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .create()
            .unwrap();
        let m = rdkafka::producer::Producer::client(&client)
            .fetch_metadata(Some("demo.events"), Duration::from_secs(10))
            .unwrap();
        (
            m.topics()[0].partitions().len(),
            m.brokers().iter().map(|b| b.port()).collect::<Vec<_>>(),
        )
    })
    .await
    .unwrap();
    assert_eq!(metadata, (3, vec![i32::from(port)]));

    signal(&child, "-INT");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(10)).await,
        Some(0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_give_clear_errors() {
    let db = TestDb::empty().await;
    // Usage errors: clap's message and exit code 2.
    let url = db.url.clone();
    let usage = |args: &'static [&'static str], expected: &'static str| {
        let url = url.clone();
        async move {
            let o = run(&url, args).await;
            assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
            assert!(stderr(&o).contains(expected), "{args:?}: {}", stderr(&o));
        }
    };
    usage(&["frobnicate"], "unrecognized subcommand").await;
    usage(
        &["cleanup", "--older-than", "30x"],
        "invalid duration `30x`",
    )
    .await;
    usage(&["cleanup"], "--older-than").await;
    usage(
        &[
            "replay",
            "--topic",
            "t",
            "--brokers",
            "b",
            "--since",
            "last tuesday",
        ],
        "invalid time",
    )
    .await;
    usage(
        &["relay", "--brokers", "b", "--instances", "0"],
        "--instances",
    )
    .await;
    usage(
        &["relay", "--brokers", "b", "-X", "acks"],
        "expected key=value",
    )
    .await;

    let no_url = tokio::task::spawn_blocking(|| outbox(&["status"]).output().unwrap())
        .await
        .unwrap();
    assert_eq!(no_url.status.code(), Some(2));
    assert!(
        stderr(&no_url).contains("--database-url"),
        "{}",
        stderr(&no_url)
    );

    // Runtime errors: one line, exit code 1.
    assert_error(
        &run("postgres://postgres@127.0.0.1:1/x", &["status"]).await,
        "cannot connect to PostgreSQL at 127.0.0.1:1/x",
    );
    assert_error(&run("not a url", &["status"]).await, "invalid database URL");
    assert_error(&run(&db.url, &["status"]).await, "run `outbox migrate`");
    assert_ok(&run(&db.url, &["migrate"]).await);
    assert_error(
        &run(
            &db.url,
            &[
                "relay",
                "--brokers",
                "127.0.0.1:9",
                "-X",
                "enable.idempotence=false",
            ],
        )
        .await,
        "must be idempotent",
    );
    insert_rows(&db.pool, TOPIC, 1, "1 hour", Some("1 hour"), false).await;
    assert_error(
        &run(
            &db.url,
            &["replay", "--topic", TOPIC, "--brokers", "127.0.0.1:9"],
        )
        .await,
        "cannot reach Kafka at 127.0.0.1:9",
    );
}

/// An operator drops parked rows while another retries one of them: the drop waits for the
/// retry's row lock, then must see that the row is no longer parked, and leave it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drop_never_deletes_a_row_retried_meanwhile() {
    use outbox_runtime::admin::{drop_parked, PoisonFilter};

    let db = TestDb::new().await;
    let ids = insert_rows(&db.pool, TOPIC, 2, "1 hour", None, true).await;
    let mut retry = db.pool.begin().await.unwrap();
    sqlx::query("UPDATE outbox_event SET parked_at = NULL, attempts = 0 WHERE id = $1")
        .bind(ids[0])
        .execute(&mut *retry)
        .await
        .unwrap();
    let dropper = {
        let pool = db.pool.clone();
        tokio::spawn(async move { drop_parked(&pool, &PoisonFilter::all()).await })
    };
    // Wait until the drop is blocked on the retried row's lock.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while count(
        &db.pool,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND wait_event_type = 'Lock' AND query LIKE 'DELETE FROM outbox_event%'",
    )
    .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the drop never waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    retry.commit().await.unwrap();
    assert_eq!(
        dropper.await.unwrap().unwrap(),
        1,
        "only the row still parked"
    );
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox_event")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, vec![ids[0]]);
}

/// `outbox status | head -1`: the reader is gone before anything is written. Like any Unix
/// filter, the command ends as if its output had been read: exit 0, nothing on stderr.
#[tokio::test]
async fn a_closed_stdout_is_an_ordinary_end() {
    let db = TestDb::new().await;
    insert_rows(&db.pool, "a.events", 3, "1 hour", None, false).await;
    insert_rows(&db.pool, "a.events", 2, "2 hours", None, true).await;
    for args in [
        &["status"][..],
        &["status", "--json"],
        &["parked", "list"],
        &["inbox", "dead", "list"],
        &["migrate"],
    ] {
        let mut cmd = outbox(args);
        cmd.env("DATABASE_URL", &db.url)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let out = tokio::task::spawn_blocking(move || {
            let mut child = cmd.spawn().expect("run outbox");
            // Closed before the command has even connected to the database.
            drop(child.stdout.take());
            child.wait_with_output().expect("wait")
        })
        .await
        .expect("join");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        assert_eq!(stderr(&out), "", "{args:?}");
    }
}

/// `GET /metrics` on `addr`: the body, or `None` while nothing answers.
fn scrape(addr: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    Some(response.split_once("\r\n\r\n")?.1.to_owned())
}

/// The value of an unlabelled sample in a Prometheus text exposition.
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_serves_prometheus_metrics_and_logs_json_filtered_by_rust_log() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 4).await;
    let addr = format!(
        "127.0.0.1:{}",
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    );
    let mut cmd = outbox(&[
        "relay",
        "--metrics-addr",
        &addr,
        "--log-format",
        "json",
        "--poll-interval",
        "100ms",
    ]);
    cmd.env("DATABASE_URL", &db.url)
        .env("KAFKA_BROKERS", kafka.bootstrap())
        // The relay's batch records are debug lines: shown only because RUST_LOG asks.
        .env("RUST_LOG", "info,outbox_runtime::relay=debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = ChildGuard(cmd.spawn().expect("start relay"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let err = child.0.stderr.take().unwrap();
    tokio::task::spawn_blocking(move || wait_line(&mut out, "outbox relay:"))
        .await
        .unwrap();

    let total = emit_posted(&db.pool, 10, 10).await;
    consume(&kafka.bootstrap(), TOPIC, 4, Duration::from_secs(30), |r| {
        r.len() >= total
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let metrics = loop {
        let scraped = {
            let addr = addr.clone();
            tokio::task::spawn_blocking(move || scrape(&addr))
                .await
                .unwrap()
        };
        if let Some(m) = scraped.filter(|m| {
            sample(m, "outbox_relay_published_total").is_some_and(|n| n >= total as f64)
        }) {
            break m;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{total} published in the scraped metrics"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        sample(&metrics, "outbox_relay_published_total"),
        Some(total as f64),
        "{metrics}"
    );
    assert!(
        metrics.contains("# TYPE outbox_relay_published_total counter"),
        "{metrics}"
    );

    signal(&child, "-TERM");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(20)).await,
        Some(0)
    );
    let mut logs = String::new();
    std::io::Read::read_to_string(&mut BufReader::new(err), &mut logs).unwrap();
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let messages = |level: &str| -> Vec<String> {
        lines
            .iter()
            .filter(|l| l["level"] == level)
            .filter_map(|l| l["fields"]["message"].as_str().map(str::to_owned))
            .collect()
    };
    assert!(
        messages("INFO").iter().any(|m| m == "outbox relay started"),
        "{logs}"
    );
    assert!(
        messages("DEBUG")
            .iter()
            .any(|m| m == "outbox relay batch recorded"),
        "{logs}"
    );
}

#[tokio::test]
async fn an_invalid_rust_log_is_a_clear_error() {
    let mut cmd = outbox(&["status", "--database-url", "postgres://127.0.0.1:1/none"]);
    cmd.env("RUST_LOG", "outbox_runtime=loud");
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).starts_with("error: invalid RUST_LOG: "),
        "{}",
        stderr(&out)
    );
}

/// `url` with `params` added to its query string.
fn with_params(url: &str, params: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{params}")
}

/// Makes sure the server takes TLS connections: turns `ssl` on (a reload, which nothing else
/// notices, and which stays) if it is off and a certificate is configured, as on Debian's and
/// the official images' servers.
async fn require_server_tls(db: &TestDb) {
    let ssl: String = sqlx::query_scalar("SHOW ssl")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    if ssl == "on" {
        return;
    }
    sqlx::query("ALTER SYSTEM SET ssl = on")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&db.pool)
        .await
        .unwrap();
    // The reload is a signal: new sessions see it once the postmaster has read the files.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let fresh = db.pool(1).await;
        let ssl: String = sqlx::query_scalar("SHOW ssl")
            .fetch_one(&fresh)
            .await
            .unwrap();
        if ssl == "on" {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server does not turn ssl on: is a certificate configured (ssl_cert_file)?"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_talks_tls_to_postgres_and_verifies_the_server() {
    let db = TestDb::new().await;
    require_server_tls(&db).await;

    // TLS required: works, and every session of the command is encrypted.
    let tls = with_params(&db.url, "sslmode=require&application_name=outbox-over-tls");
    assert_ok(&run(&tls, &["status"]).await);
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 1).await;
    let mut cmd = outbox(&["relay"]);
    cmd.env("DATABASE_URL", &tls)
        .env("KAFKA_BROKERS", kafka.bootstrap())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = ChildGuard(cmd.spawn().expect("start relay"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    tokio::task::spawn_blocking(move || wait_line(&mut out, "outbox relay:"))
        .await
        .unwrap();
    let (sessions, encrypted): (i64, Option<bool>) = sqlx::query_as(
        "SELECT count(*), bool_and(s.ssl) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.application_name = 'outbox-over-tls'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(sessions >= 1, "the relay's sessions");
    assert_eq!(encrypted, Some(true), "every session of the relay is TLS");
    signal(&child, "-TERM");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(20)).await,
        Some(0)
    );

    // The server is verified when asked: a local server's certificate is self-signed (no
    // trusted CA signed it) and names a host, never 127.0.0.1, so `verify-full` to 127.0.0.1
    // is refused.
    assert!(db.url.contains("@127.0.0.1:"), "{}", db.url);
    assert_error(
        &run(&with_params(&db.url, "sslmode=verify-full"), &["status"]).await,
        "cannot connect to PostgreSQL",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_passes_sasl_ssl_settings_to_kafka() {
    let db = TestDb::new().await;
    // Nothing listens there: the relay starts (librdkafka took the settings) and keeps trying.
    let nowhere = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let secured = [
        "-X",
        "security.protocol=SASL_SSL",
        "-X",
        "sasl.mechanisms=SCRAM-SHA-512",
        "-X",
        "sasl.username=relay",
        "-X",
        "sasl.password=secret",
    ];
    let mut cmd = outbox(&[&["relay", "--brokers", &nowhere][..], &secured].concat());
    cmd.env("DATABASE_URL", &db.url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = ChildGuard(cmd.spawn().expect("start relay"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let mut err = child.0.stderr.take().unwrap();
    let started = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        line
    })
    .await
    .unwrap();
    if !started.contains("outbox relay:") {
        let mut logs = String::new();
        std::io::Read::read_to_string(&mut err, &mut logs).unwrap();
        panic!("the relay did not start with SASL_SSL settings: {logs}");
    }
    signal(&child, "-TERM");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(20)).await,
        Some(0)
    );

    // A mechanism librdkafka does not know is refused when the producer is created.
    let mut cmd = outbox(&[
        "relay",
        "--brokers",
        &nowhere,
        "-X",
        "security.protocol=SASL_SSL",
        "-X",
        "sasl.mechanisms=NO-SUCH-MECHANISM",
    ]);
    cmd.env("DATABASE_URL", &db.url);
    let refused = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    assert_error(&refused, "cannot create the Kafka producer");
}
