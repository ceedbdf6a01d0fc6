//! `migrate`, then `status` against counts made by hand, as tables, JSON and a health check.

use outbox_tests::{HeldTransaction, TestDb};

use crate::support::{assert_error, assert_ok, insert_rows, run, stderr, stdout};

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
    assert_eq!(status["inbox_processors"], 0);

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
async fn status_check_fails_while_a_health_warning_stands_and_names_its_cause() {
    let db = TestDb::new().await;
    // Healthy, once the server's own autovacuum setting is left out (off on some machines).
    let healthy = run(
        &db.url,
        &["status", "--check", "--ignore", "autovacuum_off"],
    )
    .await;
    assert_ok(&healthy);
    let text = stdout(&healthy);
    assert!(text.contains("health: no warnings"), "{text}");
    let outbox_line = text
        .lines()
        .find(|l| l.starts_with("outbox_event"))
        .unwrap_or_else(|| panic!("the tables' figures: {text}"));
    assert_eq!(
        outbox_line.split_whitespace().collect::<Vec<_>>()[1..4],
        ["0", "0", "on"],
        "{text}"
    );

    // A session left idle in a transaction that holds an id.
    let held = HeldTransaction::open(&db.url, "stuck-report").await;
    let pid = held.pid;
    let args = [
        "status",
        "--check",
        "--warn-transaction-age",
        "1s",
        "--ignore",
        "autovacuum-off",
    ];
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let failed = loop {
        let out = run(&db.url, &args).await;
        if !out.status.success() {
            break out;
        }
        assert!(tokio::time::Instant::now() < deadline, "{}", stdout(&out));
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert_error(
        &failed,
        &format!(
            "1 health warning(s) stand (long_transaction); the first: session {pid} \
             (application `stuck-report`, user postgres, idle in transaction) has held a \
             transaction open for"
        ),
    );
    assert!(
        stdout(&failed).contains(&format!("  ! session {pid} (application `stuck-report`")),
        "the warnings are printed: {}",
        stdout(&failed)
    );
    let json = run(
        &db.url,
        &["status", "--json", "--warn-transaction-age", "1s"],
    )
    .await;
    assert_ok(&json);
    let report: serde_json::Value = serde_json::from_str(&stdout(&json)).unwrap();
    let warning = report["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["kind"] == "long_transaction")
        .unwrap_or_else(|| panic!("{report}"));
    assert_eq!(warning["pid"], pid);
    assert_eq!(warning["state"], "idle in transaction");
    assert_eq!(
        report["relay_instances"], 0,
        "the backlog figures stay at the top"
    );

    held.commit().await;
    assert_ok(&run(&db.url, &args).await);

    // A kind that does not exist is refused, naming the kinds that do.
    let typo = run(&db.url, &["status", "--ignore", "autovacum_off"]).await;
    assert_eq!(typo.status.code(), Some(2));
    let err = stderr(&typo);
    assert!(
        err.contains("unknown warning kind `autovacum_off`: expected one of autovacuum_off,"),
        "{err}"
    );
}
