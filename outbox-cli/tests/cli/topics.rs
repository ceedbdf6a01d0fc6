//! `topics ensure` against a broker process (tansu): the topics of the outbox's waiting rows and those
//! named, each with its retry and dead-letter topics, created with the partitions asked; what
//! exists is left as it is.

use outbox_tests::kafka::Kafka;
use outbox_tests::TestDb;

use crate::support::{assert_error, assert_ok, insert_rows, run, stdout};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_ensure_creates_what_the_waiting_rows_need_and_leaves_what_exists() {
    let db = TestDb::new().await;
    // tansu: librdkafka's mock cluster does not answer CreateTopics.
    let kafka = Kafka::tansu().await;
    kafka.create_topic("a.events", 3).await;
    // Rows waiting for a topic that exists, and for one that does not (the relay holds them).
    insert_rows(&db.pool, "a.events", 1, "1 minute", None, false).await;
    insert_rows(&db.pool, "b.events", 2, "1 minute", None, false).await;
    let bootstrap = kafka.bootstrap();
    let ensure = |extra: &[&str]| {
        let mut args = vec!["topics", "ensure", "--brokers", bootstrap.as_str()];
        args.extend_from_slice(extra);
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let run_with = |extra: &[&str]| {
        let args = ensure(extra);
        let url = db.url.clone();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run(&url, &args).await
        }
    };

    assert_error(
        &run_with(&[]).await,
        "topic `b.events` does not exist: say how many partitions it gets",
    );

    let dry = run_with(&["--partitions", "2", "--dry-run"]).await;
    assert_ok(&dry);
    let text = stdout(&dry);
    let cells = |topic: &str| -> Vec<String> {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(topic))
            .unwrap_or_else(|| panic!("{topic} in {text}"))
            .split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(cells("a.events"), ["a.events", "source", "3", "exists"]);
    assert_eq!(
        cells("a.events.dlq"),
        ["a.events.dlq", "dead-letter", "3", "would create"]
    );
    assert_eq!(
        cells("b.events"),
        ["b.events", "source", "2", "would create"]
    );
    assert!(
        text.contains("dry run: 5 of 6 topics would be created"),
        "{text}"
    );

    let created = run_with(&["--partitions", "2", "--retry-tiers", "2", "--json"]).await;
    assert_ok(&created);
    let report: serde_json::Value = serde_json::from_str(&stdout(&created)).unwrap();
    let rows: Vec<(String, String, i64, String)> = report
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["topic"].as_str().unwrap().to_owned(),
                t["role"].as_str().unwrap().to_owned(),
                t["partitions"].as_i64().unwrap(),
                t["action"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let row = |topic: &str, role: &str, partitions: i64, action: &str| {
        (
            topic.to_owned(),
            role.to_owned(),
            partitions,
            action.to_owned(),
        )
    };
    assert_eq!(
        rows,
        [
            row("a.events", "source", 3, "exists"),
            row("a.events.retry-1", "retry", 3, "created"),
            row("a.events.retry-2", "retry", 3, "created"),
            row("a.events.dlq", "dead_letter", 3, "created"),
            row("b.events", "source", 2, "created"),
            row("b.events.retry-1", "retry", 2, "created"),
            row("b.events.retry-2", "retry", 2, "created"),
            row("b.events.dlq", "dead_letter", 2, "created"),
        ]
    );

    // On the broker now: a second run creates nothing.
    let again = run_with(&["--retry-tiers", "2"]).await;
    assert_ok(&again);
    assert!(
        stdout(&again).contains("created 0 of 8 topics; the others exist"),
        "{}",
        stdout(&again)
    );
}
