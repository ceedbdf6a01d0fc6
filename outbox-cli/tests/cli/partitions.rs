//! `partitions`: list, convert an installation from before partitions, change the width, and
//! refuse a width that cannot work.

use outbox_tests::TestDb;

use crate::support::{assert_error, assert_ok, run, stderr, stdout};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_lists_converts_and_changes_the_width() {
    let db = TestDb::before_partitions().await;
    let url = &db.url;
    let listed = run(url, &["partitions", "list"]).await;
    assert_ok(&listed);
    assert!(
        stdout(&listed).contains("processed_event is not partitioned"),
        "{}",
        stdout(&listed)
    );
    let refused = run(url, &["partitions", "convert"]).await;
    assert_error(&refused, "--yes");

    let converted = run(url, &["partitions", "convert", "--yes"]).await;
    assert_ok(&converted);
    assert!(
        stdout(&converted).contains("its rows stay in processed_event_history"),
        "{}",
        stdout(&converted)
    );
    let again = run(url, &["partitions", "convert", "--yes"]).await;
    assert_ok(&again);
    assert!(stdout(&again).contains("partitioned already"));

    let set = run(
        url,
        &["partitions", "set", "--width", "1h", "--ahead", "4d"],
    )
    .await;
    assert_ok(&set);
    assert!(
        stdout(&set).contains("partitions 1h00m wide from the last one on, kept 4d00h ahead"),
        "{}",
        stdout(&set)
    );
    let json = run(url, &["partitions", "list", "--json"]).await;
    assert_ok(&json);
    let layout: serde_json::Value = serde_json::from_str(&stdout(&json)).unwrap();
    assert_eq!(layout["width"], 3600);
    assert_eq!(layout["ahead"], 4 * 86_400);
    let partitions = layout["partitions"].as_array().unwrap();
    assert_eq!(partitions[0]["name"], "processed_event_history");
    assert!(partitions[0]["from"].is_null());
    let table = run(url, &["partitions", "list"]).await;
    assert_ok(&table);
    let text = stdout(&table);
    assert!(text.contains("processed_event_history"), "{text}");
    assert!(text.contains("(everything before)"), "{text}");
    assert!(
        text.contains(&format!(
            "processed_event: {} partitions, 1h00m wide, kept 4d00h ahead",
            partitions.len()
        )),
        "{text}"
    );

    let narrow = run(
        url,
        &["partitions", "set", "--width", "30s", "--ahead", "1d"],
    )
    .await;
    assert_error(
        &narrow,
        "a partition width must be a whole number of minutes",
    );
    let close = run(
        url,
        &["partitions", "set", "--width", "1h", "--ahead", "10m"],
    )
    .await;
    assert_error(&close, "at least an hour ahead");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_converts_from_the_command_line_and_lists_its_partitions() {
    let db = TestDb::before_partitions().await;
    let url = &db.url;
    let listed = run(url, &["partitions", "list", "--table", "outbox"]).await;
    assert_ok(&listed);
    assert!(
        stdout(&listed).contains("outbox_event is not partitioned"),
        "{}",
        stdout(&listed)
    );
    let converted = run(
        url,
        &["partitions", "convert", "--table", "outbox", "--yes"],
    )
    .await;
    assert_ok(&converted);
    assert!(
        stdout(&converted)
            .contains("outbox_event is partitioned: its rows stay in outbox_event_history"),
        "{}",
        stdout(&converted)
    );
    let table = run(url, &["partitions", "list", "--table", "outbox"]).await;
    assert_ok(&table);
    let text = stdout(&table);
    assert!(text.contains("outbox_event_history"), "{text}");
    assert!(text.contains("outbox_event: "), "{text}");
    assert!(text.contains("1d00h wide, kept 3d00h ahead"), "{text}");
    // A usage error: clap's message and exit code 2.
    let unknown = run(url, &["partitions", "list", "--table", "outboxes"]).await;
    assert_eq!(unknown.status.code(), Some(2));
    assert!(
        stderr(&unknown).contains("unknown table `outboxes` (expected outbox, inbox or processed)"),
        "{}",
        stderr(&unknown)
    );
}
