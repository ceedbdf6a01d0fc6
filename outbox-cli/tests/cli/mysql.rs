//! The CLI against a MariaDB database (issue 38): `migrate` applies the MySQL migrations,
//! `relay` publishes its outbox, `status` shows it; the commands not built for it yet say so.

use std::io::BufReader;
use std::process::Stdio;
use std::time::Duration;

use outbox_tests::kafka::{consume, Kafka};
use outbox_tests::mysql::{count, MySqlTestDb};
use outbox_tests::ChildGuard;

use crate::support::{
    assert_error, assert_ok, emit_posted, outbox, run, signal, stdout, wait_exit, wait_line, TOPIC,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_applies_the_mysql_migrations_and_other_commands_say_what_works() {
    let db = MySqlTestDb::empty().await;
    let first = run(&db.url, &["migrate"]).await;
    assert_ok(&first);
    let applied = outbox_runtime::mysql::MIGRATIONS.len();
    assert!(
        stdout(&first).contains(&format!("applied {applied} migrations")),
        "{}",
        stdout(&first)
    );
    assert_eq!(
        count(&db.pool, "SELECT COUNT(*) FROM outbox_key_lock").await,
        65_536
    );
    let again = run(&db.url, &["migrate"]).await;
    assert_ok(&again);
    assert!(
        stdout(&again).contains("schema up to date"),
        "{}",
        stdout(&again)
    );
    assert_error(
        &run(&db.url, &["inbox", "dead", "list"]).await,
        "only `outbox migrate`, `relay`, `status`, `cleanup`, `parked` and `replay` take a mysql:// URL",
    );
}

/// `outbox parked` on MariaDB: the parked rows listed (as text and JSON), one retried by id
/// (un-parked, attempts reset, the retry recorded), the rest dropped by topic, each after the
/// same refusals as on PostgreSQL; unparked rows untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_events_are_listed_retried_and_dropped_on_mariadb() {
    let db = MySqlTestDb::new().await;
    emit_posted(&db.pool, 2, 5).await;
    sqlx::query(
        "UPDATE outbox_event SET parked_at = UTC_TIMESTAMP(6), attempts = 5, \
             last_error = 'Message size too large' \
         ORDER BY id LIMIT 3",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let parked: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM outbox_event WHERE parked_at IS NOT NULL ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();

    let list = run(&db.url, &["parked", "list"]).await;
    assert_ok(&list);
    let text = stdout(&list);
    let lines = text
        .lines()
        .filter(|l| l.contains("Message size too large"));
    assert_eq!(lines.count(), 3, "{text}");
    let json = run(&db.url, &["parked", "list", "--topic", TOPIC, "--json"]).await;
    assert_ok(&json);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&stdout(&json)).unwrap();
    let ids: Vec<i64> = rows.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(ids, parked);
    assert_eq!(
        (
            rows[0]["attempts"].as_i64(),
            rows[0]["payload"]["seq"].as_i64()
        ),
        (Some(5), Some(0))
    );

    assert_error(&run(&db.url, &["parked", "retry"]).await, "say which rows");
    assert_error(
        &run(&db.url, &["parked", "drop", "--topic", TOPIC]).await,
        "pass --yes",
    );
    let first = parked[0].to_string();
    let retry = run(&db.url, &["parked", "retry", "--id", &first, "--yes"]).await;
    assert_ok(&retry);
    assert!(
        stdout(&retry).contains("un-parked 1 events"),
        "{}",
        stdout(&retry)
    );
    assert_eq!(
        count(
            &db.pool,
            &format!(
                "SELECT COUNT(*) FROM outbox_event WHERE id = {first} AND parked_at IS NULL \
                 AND attempts = 0 AND retried_by = 'outbox parked retry'"
            )
        )
        .await,
        1
    );
    let dropped = run(&db.url, &["parked", "drop", "--topic", TOPIC, "--yes"]).await;
    assert_ok(&dropped);
    assert!(
        stdout(&dropped).contains("dropped 2 parked events"),
        "{}",
        stdout(&dropped)
    );
    assert_eq!(
        count(&db.pool, "SELECT COUNT(*) FROM outbox_event").await,
        8,
        "the unparked rows and the retried one kept"
    );
    let none = run(&db.url, &["parked", "list"]).await;
    assert_ok(&none);
    assert!(
        stdout(&none).contains("no parked events"),
        "{}",
        stdout(&none)
    );
}

/// `outbox cleanup` deletes the published outbox rows and the dedup rows past their retention
/// on MariaDB, in batches, and never an unpublished or parked row; the inbox, which is not
/// built there, is left out by default and refused when named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_deletes_what_is_past_the_retention_on_mariadb() {
    let db = MySqlTestDb::new().await;
    emit_posted(&db.pool, 5, 10).await;
    // 20 published 40 days ago, 10 published today, 10 unpublished, 10 parked.
    sqlx::raw_sql(
        "UPDATE outbox_event SET published_at = UTC_TIMESTAMP(6) - INTERVAL 40 DAY \
         WHERE id <= (SELECT m FROM (SELECT MIN(id) + 19 AS m FROM outbox_event) AS x); \
         UPDATE outbox_event SET published_at = UTC_TIMESTAMP(6) \
         WHERE published_at IS NULL ORDER BY id LIMIT 10; \
         UPDATE outbox_event SET parked_at = UTC_TIMESTAMP(6) - INTERVAL 40 DAY \
         WHERE published_at IS NULL ORDER BY id LIMIT 10; \
         INSERT INTO processed_event (event_id, handler, processed_at) \
         SELECT event_id, 'g/h', UTC_TIMESTAMP(6) - INTERVAL 10 DAY FROM outbox_event; \
         INSERT INTO processed_event (event_id, handler, processed_at) \
         SELECT event_id, 'g/new', UTC_TIMESTAMP(6) FROM outbox_event",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // `status` counts the dedup rows, as on PostgreSQL.
    let status = run(&db.url, &["status", "--json"]).await;
    assert_ok(&status);
    let status: serde_json::Value = serde_json::from_str(&stdout(&status)).unwrap();
    assert_eq!(status["processed_event_rows"], 100, "{status}");
    let dry = run(
        &db.url,
        &[
            "cleanup",
            "--older-than",
            "30d",
            "--dedup-older-than",
            "7d",
            "--dry-run",
        ],
    )
    .await;
    assert_ok(&dry);
    assert!(
        stdout(&dry).contains("would delete 70 rows: 20 from outbox_event")
            && stdout(&dry).contains("50 from processed_event"),
        "{}",
        stdout(&dry)
    );
    let done = run(
        &db.url,
        &[
            "cleanup",
            "--older-than",
            "30d",
            "--dedup-older-than",
            "7d",
            "--batch",
            "7",
            "--yes",
        ],
    )
    .await;
    assert_ok(&done);
    assert!(
        stdout(&done).contains("outbox_event: deleted 20 rows"),
        "{}",
        stdout(&done)
    );
    assert!(
        stdout(&done).contains("processed_event: deleted 50 rows"),
        "{}",
        stdout(&done)
    );
    assert_eq!(
        count(&db.pool, "SELECT COUNT(*) FROM outbox_event").await,
        30
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT COUNT(*) FROM outbox_event WHERE published_at IS NULL"
        )
        .await,
        20,
        "unpublished and parked rows kept"
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT COUNT(*) FROM processed_event WHERE handler = 'g/new'"
        )
        .await,
        50
    );
    assert_error(
        &run(
            &db.url,
            &[
                "cleanup",
                "--older-than",
                "30d",
                "--table",
                "inbox",
                "--yes",
            ],
        )
        .await,
        "inbox_event is not built on MariaDB/MySQL yet",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_publishes_a_mariadb_outbox_and_stops_on_sigterm() {
    let db = MySqlTestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 4).await;
    // With retention beside it (nothing is old enough to go here).
    let mut cmd = outbox(&[
        "relay",
        "--instances",
        "2",
        "--poll-interval",
        "100ms",
        "--retention",
        "30d",
    ]);
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
    assert!(line.contains("2 instance(s)"), "{line}");
    let total = emit_posted(&db.pool, 20, 10).await;
    let received = consume(&kafka.bootstrap(), TOPIC, 4, Duration::from_secs(30), |r| {
        r.len() >= total
    })
    .await;
    assert_eq!(received.len(), total);
    // `status` sees the two instances, and what they published in the last minute.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = run(&db.url, &["status", "--json"]).await;
        assert_ok(&status);
        let status: serde_json::Value = serde_json::from_str(&stdout(&status)).unwrap();
        let topic = &status["outbox"][0];
        if status["relay_instances"] == 2 && topic["published_last_minute"] == total {
            assert_eq!(topic["topic"], TOPIC);
            assert_eq!(topic["unpublished"], 0);
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = run(&db.url, &["status", "--max-age", "1h"]).await;
    assert_ok(&text);
    let text = stdout(&text);
    assert!(
        text.contains("outbox (2 relay instances running)"),
        "{text}"
    );
    assert!(text.contains(TOPIC), "{text}");
    assert_ok(&run(&db.url, &["status", "--check"]).await);
    signal(&child, "-TERM");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(20)).await,
        Some(0)
    );
    let rest = tokio::task::spawn_blocking(move || wait_line(&mut out, "stopped"))
        .await
        .unwrap();
    assert!(rest.contains("0 unpublished"), "{rest}");
    // A transaction left open holds InnoDB's purge back: `--check` names its connection and
    // how to end it, once it is older than the threshold.
    let mut open = db.connection().await;
    sqlx::raw_sql("BEGIN; SELECT COUNT(*) FROM outbox_event FOR UPDATE")
        .execute(&mut open)
        .await
        .unwrap();
    let id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
        .fetch_one(&mut open)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let failed = loop {
        let check = run(
            &db.url,
            &["status", "--check", "--warn-transaction-age", "1s"],
        )
        .await;
        if !check.status.success() {
            break check;
        }
        assert!(tokio::time::Instant::now() < deadline, "never warned");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_error(&failed, "(long_transaction)");
    assert_error(&failed, &format!("connection {id} "));
    assert_error(&failed, &format!("KILL {id} ends it"));
    assert_eq!(
        count(
            &db.pool,
            "SELECT COUNT(*) FROM outbox_event WHERE published_at IS NULL"
        )
        .await,
        0
    );
}
