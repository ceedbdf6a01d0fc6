//! The commands on RabbitMQ (the machine's node, names of each test's own): `topics ensure
//! --transport rabbitmq` declares and reports a group's queues, `relay --rabbitmq` publishes
//! into them, and `status --rabbitmq` shows what they hold.

use std::process::Stdio;
use std::time::Duration;

use outbox_tests::rabbitmq::{delete_exchange, delete_queue, unique_name, SHARED_URL};
use outbox_tests::{ChildGuard, TestDb};

use crate::support::{assert_error, assert_ok, count, insert_rows, outbox, run, stderr, stdout};

/// Runs `status --json` with the group's queues and returns them (`rabbitmq_queues`).
async fn queues_status(db: &str, topic: &str, group: &str) -> Vec<serde_json::Value> {
    let out = run(
        db,
        &[
            "status",
            "--json",
            "--rabbitmq",
            SHARED_URL,
            "--rabbitmq-shards",
            "2",
            "--group",
            group,
            "--topic",
            topic,
        ],
    )
    .await;
    assert_ok(&out);
    let status: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("status JSON");
    status["rabbitmq_queues"]
        .as_array()
        .expect("rabbitmq_queues")
        .clone()
}

/// Runs `topics ensure --transport rabbitmq` for `topic` and `group`, 2 shards.
async fn ensure(db: &str, topic: &str, group: &str, dry_run: bool) -> std::process::Output {
    let mut args = vec![
        "topics",
        "ensure",
        "--transport",
        "rabbitmq",
        "--rabbitmq",
        SHARED_URL,
        "--shards",
        "2",
        "--group",
        group,
        "--topic",
        topic,
    ];
    if dry_run {
        args.push("--dry-run");
    }
    run(db, &args).await
}

/// The ready messages of the group's shard queues, all together.
fn ready_in_shards(queues: &[serde_json::Value]) -> u64 {
    queues
        .iter()
        .filter(|q| {
            let name = q["queue"].as_str().unwrap_or_default();
            !name.ends_with(".retry") && !name.ends_with(".dlq")
        })
        .map(|q| q["messages"].as_u64().expect("an existing queue's depth"))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_ensure_relay_and_status_on_rabbitmq() {
    let db = TestDb::new().await;
    let topic = unique_name("cli.events");
    let group = unique_name("billing");
    // Nothing declared yet: the dry run says what would be, and declares nothing.
    let dry = ensure(&db.url, &topic, &group, true).await;
    assert_ok(&dry);
    let text = stdout(&dry);
    assert_eq!(text.matches("would create").count(), 5, "{text}");
    assert!(text.contains("dry run: nothing declared"), "{text}");
    let before = queues_status(&db.url, &topic, &group).await;
    assert_eq!(before.len(), 5, "{before:?}");
    assert!(before.iter().all(|q| q["exists"] == false), "{before:?}");

    // Declared: two shard queues, their delay queues and the dead-letter queue, all empty.
    let declared = ensure(&db.url, &topic, &group, false).await;
    assert_ok(&declared);
    let text = stdout(&declared);
    for queue in [
        format!("{topic}.{group}.0"),
        format!("{topic}.{group}.1"),
        format!("{topic}.{group}.0.retry"),
        format!("{topic}.{group}.1.retry"),
        format!("{topic}.dlq"),
    ] {
        assert!(text.contains(&queue), "{queue} in: {text}");
    }
    assert_eq!(text.matches("exists").count(), 5, "{text}");
    let table = run(
        &db.url,
        &[
            "status",
            "--rabbitmq",
            SHARED_URL,
            "--rabbitmq-shards",
            "2",
            "--group",
            &group,
            "--topic",
            &topic,
        ],
    )
    .await;
    assert_ok(&table);
    let text = stdout(&table);
    assert!(text.contains("RabbitMQ queues"), "{text}");
    assert!(!text.contains("guest:guest"), "the password shown: {text}");
    // No consumer reads the shard queues yet.
    assert_eq!(text.matches("no consumer").count(), 2, "{text}");

    // The relay publishes the rows into them: status counts them there.
    let rows = 40;
    insert_rows(&db.pool, &topic, rows, "1 minute", None, false).await;
    let mut relay = outbox(&[
        "relay",
        "--rabbitmq",
        SHARED_URL,
        "--shards",
        "2",
        "--poll-interval",
        "100ms",
    ]);
    relay
        .env("DATABASE_URL", &db.url)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let child = ChildGuard(relay.spawn().expect("start relay"));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let unpublished = "SELECT count(*) FROM outbox_event WHERE published_at IS NULL";
    while count(&db.pool, unpublished).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay published every row within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(child);
    let after = queues_status(&db.url, &topic, &group).await;
    assert!(after.iter().all(|q| q["exists"] == true), "{after:?}");
    assert_eq!(ready_in_shards(&after), rows as u64, "{after:?}");

    for shard in 0..2 {
        delete_queue(SHARED_URL, &format!("{topic}.{group}.{shard}")).await;
        delete_queue(SHARED_URL, &format!("{topic}.{group}.{shard}.retry")).await;
    }
    delete_queue(SHARED_URL, &format!("{topic}.dlq")).await;
    delete_exchange(SHARED_URL, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_options_refuse_what_cannot_work() {
    let db = TestDb::new().await;
    // Queues to report, but no group whose: a usage error.
    let no_group = run(&db.url, &["status", "--rabbitmq", SHARED_URL]).await;
    assert_eq!(no_group.status.code(), Some(2), "{no_group:?}");
    assert!(stderr(&no_group).contains("--group"), "{no_group:?}");
    // Kafka's producer settings with RabbitMQ: one or the other.
    let both = run(
        &db.url,
        &["relay", "--rabbitmq", SHARED_URL, "-X", "acks=all"],
    )
    .await;
    assert_eq!(both.status.code(), Some(2), "{both:?}");
    assert!(stderr(&both).contains("cannot be used with"), "{both:?}");
    // A URL the client cannot use: said before anything runs.
    assert_error(
        &run(&db.url, &["relay", "--rabbitmq", "http://127.0.0.1:5672"]).await,
        "RabbitMQ URL",
    );
    // ensure without a group: which queues would it declare?
    assert_error(
        &run(
            &db.url,
            &[
                "topics",
                "ensure",
                "--transport",
                "rabbitmq",
                "--rabbitmq",
                SHARED_URL,
                "--topic",
                "t",
            ],
        )
        .await,
        "--group",
    );
}
