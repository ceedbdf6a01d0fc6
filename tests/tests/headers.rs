//! The application's headers: stored with the event (`outbox_event.headers`), sent by the relay
//! after the framework's own, kept by a replay; reserved, empty and repeated names refused.

use std::time::Duration;

use outbox_runtime::admin::{Replay, ReplayFilter};
use outbox_runtime::inbox::{Consumer, HandlerError, Mode};
use outbox_runtime::testing::{MockKafka, Record};
use outbox_runtime::{Error, OutboxEvent, Uow};
use outbox_tests::fixtures::{posted, Posted};
use outbox_tests::payments::wait_for;
use outbox_tests::{count, Running, TestDb};
use serde_json::json;
use uuid::Uuid;

const FRAMEWORK: [&str; 6] = [
    "event_id",
    "event_type",
    "aggregate_type",
    "aggregate_id",
    "content-type",
    "outbox_id",
];

/// The record's header names, in order.
fn names(record: &Record) -> Vec<&str> {
    record.headers.iter().map(|(k, _)| k.as_str()).collect()
}

/// One unit of work (written at commit) mixing an event with headers (`tenant`,
/// `correlation_id`) and one without.
async fn emit_tagged_and_plain(pool: &sqlx::PgPool) -> (Posted, Posted) {
    let (tagged, plain) = (posted("L-1"), posted("L-2"));
    let mut uow = Uow::begin(pool).await.unwrap();
    uow.emit_with(&tagged, [("tenant", "acme"), ("correlation_id", "req-1")])
        .await
        .unwrap();
    uow.emit(&plain).await.unwrap();
    uow.commit().await.unwrap();
    (tagged, plain)
}

async fn stored(pool: &sqlx::PgPool, id: Uuid) -> serde_json::Value {
    sqlx::query_scalar("SELECT headers FROM outbox_event WHERE event_id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_are_stored_sent_after_the_frameworks_and_replayed() {
    let db = TestDb::new().await;
    let (tagged, plain) = emit_tagged_and_plain(&db.pool).await;
    // And an emit on an application-managed transaction (written at once).
    let bound = posted("L-3");
    let mut tx = db.pool.begin().await.unwrap();
    outbox_runtime::emit_with(&mut tx, &bound, [("tenant", "globex")])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    assert_eq!(
        stored(&db.pool, tagged.id).await,
        json!({"tenant": "acme", "correlation_id": "req-1"})
    );
    assert_eq!(stored(&db.pool, plain.id).await, json!({}));
    assert_eq!(
        stored(&db.pool, bound.id).await,
        json!({"tenant": "globex"})
    );

    let kafka = MockKafka::start().unwrap();
    kafka.create_topic(Posted::TOPIC, 1).unwrap();
    kafka.create_topic("ledger.rebuild", 1).unwrap();
    assert_eq!(kafka.relay_pending(&db.pool).await.unwrap(), 3);
    let check = |records: &[Record]| {
        assert_eq!(records.len(), 3);
        let by_id = |id: Uuid| {
            records
                .iter()
                .find(|r| r.header("event_id") == Some(id.to_string().as_str()))
                .unwrap()
        };
        let mut with = FRAMEWORK.to_vec();
        with.extend(["correlation_id", "tenant"]);
        assert_eq!(names(by_id(tagged.id)), with);
        assert_eq!(by_id(tagged.id).header("tenant"), Some("acme"));
        assert_eq!(by_id(tagged.id).header("correlation_id"), Some("req-1"));
        assert_eq!(names(by_id(plain.id)), FRAMEWORK.to_vec());
        assert_eq!(by_id(bound.id).header("tenant"), Some("globex"));
    };
    check(&kafka.records(Posted::TOPIC).await.unwrap());

    // A replay sends the stored headers again.
    let replay = Replay::new(db.pool.clone(), kafka.bootstrap_servers()).unwrap();
    let done = replay
        .run(
            &ReplayFilter::topic(Posted::TOPIC),
            Some("ledger.rebuild"),
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(done.published, 3);
    check(&kafka.records("ledger.rebuild").await.unwrap());
}

#[tokio::test]
async fn reserved_empty_and_repeated_header_names_are_refused_and_nothing_is_written() {
    let db = TestDb::new().await;
    for (headers, expected) in [
        (vec![("event_id", "x")], "header `event_id` is reserved"),
        (
            vec![("outbox_retry_attempts", "1")],
            "header `outbox_retry_attempts` is reserved",
        ),
        (vec![("dlq_error", "x")], "header `dlq_error` is reserved"),
        (
            vec![("content-type", "text/plain")],
            "header `content-type` is reserved",
        ),
        (vec![("", "x")], "a header has an empty name"),
        (
            vec![("tenant", "a"), ("tenant", "b")],
            "header `tenant` is given twice",
        ),
        (
            vec![("tenant", "a\0b")],
            "header `tenant` contains a NUL character",
        ),
    ] {
        let mut uow = Uow::begin(&db.pool).await.unwrap();
        let err = uow
            .emit_with(&posted("L-1"), headers.clone())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidEvent { .. }), "{err:?}");
        assert!(
            err.to_string().starts_with("cannot emit `Posted`: ")
                && err.to_string().contains(expected),
            "{headers:?}: {err}"
        );
        // The unit of work is spoiled, as by any failed emit.
        let refused = uow.commit().await.unwrap_err();
        assert!(
            matches!(refused, Error::EmitFailedEarlier { .. }),
            "{refused:?}"
        );
    }
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM outbox_event").await,
        0
    );
    assert!(outbox_runtime::is_reserved_header("outbox_anything"));
    assert!(!outbox_runtime::is_reserved_header("traceparent"));
}

#[outbox_runtime::inbox_handler]
async fn note_posted(_event: Posted, _tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
    Ok(())
}

/// An inbox-mode consumer keeps what it received of the application's headers on the inbox
/// row (none of the framework's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_rows_keep_the_applications_headers() {
    let db = TestDb::new().await;
    let (tagged, plain) = emit_tagged_and_plain(&db.pool).await;
    let kafka = MockKafka::start().unwrap();
    kafka.create_topic(Posted::TOPIC, 1).unwrap();
    assert_eq!(kafka.relay_pending(&db.pool).await.unwrap(), 2);

    let consumer = Consumer::builder(db.pool.clone())
        .brokers(kafka.bootstrap_servers())
        .group_id("ledger-reader")
        .handler(note_posted)
        .mode(Mode::Inbox)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for(
        "2 inbox rows processed",
        Duration::from_secs(30),
        || async { count(&db.pool, "SELECT count(*) FROM inbox_event WHERE processed").await == 2 },
    )
    .await;
    running.stop().await;
    let inbox = |id: Uuid| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, serde_json::Value>(
                "SELECT headers FROM inbox_event WHERE event_id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(
        inbox(tagged.id).await,
        json!({"tenant": "acme", "correlation_id": "req-1"})
    );
    assert_eq!(inbox(plain.id).await, json!({}));
}
