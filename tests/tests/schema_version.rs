//! Schema versions: `#[outbox(version = N)]` sent in the `outbox_schema_version` header (none
//! for version 1), stored on inbox rows, seen in a handler's metadata; a handler takes its own
//! version and the ones it declares, an upcaster makes its event from an older payload, and any
//! other version is a dead letter that says so.

use std::time::Duration;

use outbox_runtime::admin::{Replay, ReplayFilter};
use outbox_runtime::inbox::{Consumer, ConsumerBuilder, Handler, HandlerError, MessageMeta, Mode};
use outbox_runtime::testing::{self, Delivery, MockKafka};
use outbox_runtime::{inbox_handler, OutboxEvent, OutboxRecord, Uow, SCHEMA_VERSION_HEADER};
use outbox_tests::kafka::{consume, produce, Outgoing};
use outbox_tests::payments::wait_for;
use outbox_tests::{count, Running, TestDb};
use serde_json::json;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

const TOPIC: &str = "customer.events";

/// Version 1: one `name`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(
    topic = "customer.events",
    aggregate_type = "Customer",
    event_type = "CustomerRenamed"
)]
struct RenamedV1 {
    #[outbox(aggregate_id)]
    customer_id: Uuid,
    name: String,
}

/// Version 2: the name split in two.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(
    topic = "customer.events",
    aggregate_type = "Customer",
    event_type = "CustomerRenamed",
    version = 2
)]
struct CustomerRenamed {
    #[outbox(aggregate_id)]
    customer_id: Uuid,
    first_name: String,
    last_name: String,
}

/// Version 3, which the consumers here do not know.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(
    topic = "customer.events",
    aggregate_type = "Customer",
    event_type = "CustomerRenamed",
    version = 3
)]
struct RenamedV3 {
    #[outbox(aggregate_id)]
    customer_id: Uuid,
    names: Vec<String>,
}

/// Records the name it was given, and the version the metadata says it was sent with.
#[inbox_handler]
async fn rename(
    event: CustomerRenamed,
    tx: &mut PgConnection,
    meta: &MessageMeta,
) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO names (customer_id, first_name, last_name, version) VALUES ($1, $2, $3, $4)",
    )
    .bind(event.customer_id)
    .bind(&event.first_name)
    .bind(&event.last_name)
    .bind(meta.schema_version() as i32)
    .execute(tx)
    .await?;
    Ok(())
}

/// Version 1's payload made into version 2.
fn upcast_v1(v1: serde_json::Value) -> Result<CustomerRenamed, outbox_runtime::inbox::BoxError> {
    let name = v1["name"].as_str().ok_or("version 1 has no `name`")?;
    let (first, last) = name.split_once(' ').unwrap_or((name, ""));
    Ok(CustomerRenamed {
        customer_id: serde_json::from_value(v1["customer_id"].clone())?,
        first_name: first.into(),
        last_name: last.into(),
    })
}

async fn create_names(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE names (customer_id uuid PRIMARY KEY, first_name text NOT NULL, \
         last_name text NOT NULL, version int NOT NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// The three versions, one customer each, emitted in one unit of work (version 2 with an
/// application header too): their ids, in version order.
async fn emit_three_versions(pool: &PgPool) -> [Uuid; 3] {
    let v1 = RenamedV1 {
        customer_id: Uuid::now_v7(),
        name: "Ada Lovelace".into(),
    };
    let v2 = CustomerRenamed {
        customer_id: Uuid::now_v7(),
        first_name: "Grace".into(),
        last_name: "Hopper".into(),
    };
    let v3 = RenamedV3 {
        customer_id: Uuid::now_v7(),
        names: vec!["Alan".into(), "Turing".into()],
    };
    let mut uow = Uow::begin(pool).await.unwrap();
    let ids = [
        uow.emit(&v1).await.unwrap(),
        uow.emit_with(&v2, [("tenant", "acme")]).await.unwrap(),
        uow.emit(&v3).await.unwrap(),
    ];
    uow.commit().await.unwrap();
    ids
}

async fn stored_headers(pool: &PgPool, table: &str, id: Uuid) -> serde_json::Value {
    sqlx::query_scalar(&format!("SELECT headers FROM {table} WHERE event_id = $1"))
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_is_stored_sent_as_a_header_and_replayed_and_version_1_sends_none() {
    assert_eq!(RenamedV1::SCHEMA_VERSION, 1);
    assert_eq!(CustomerRenamed::SCHEMA_VERSION, 2);
    let v2 = CustomerRenamed {
        customer_id: Uuid::nil(),
        first_name: "a".into(),
        last_name: "b".into(),
    };
    assert_eq!(OutboxRecord::from_event(&v2).unwrap().schema_version(), 2);

    let db = TestDb::new().await;
    let [v1, v2, v3] = emit_three_versions(&db.pool).await;
    assert_eq!(
        stored_headers(&db.pool, "outbox_event", v1).await,
        json!({})
    );
    assert_eq!(
        stored_headers(&db.pool, "outbox_event", v2).await,
        json!({"tenant": "acme", SCHEMA_VERSION_HEADER: "2"})
    );
    assert_eq!(
        stored_headers(&db.pool, "outbox_event", v3).await,
        json!({SCHEMA_VERSION_HEADER: "3"})
    );

    let kafka = MockKafka::start().unwrap();
    kafka.create_topic(TOPIC, 1).unwrap();
    kafka.create_topic("customer.rebuild", 1).unwrap();
    assert_eq!(kafka.relay_pending(&db.pool).await.unwrap(), 3);
    let versions = |records: &[testing::Record]| -> Vec<Option<String>> {
        records
            .iter()
            .map(|r| r.header(SCHEMA_VERSION_HEADER).map(str::to_owned))
            .collect()
    };
    let records = kafka.records(TOPIC).await.unwrap();
    assert_eq!(
        versions(&records),
        [None, Some("2".into()), Some("3".into())]
    );
    assert_eq!(records[1].header("tenant"), Some("acme"));

    // A replay sends the versions again.
    let replay = Replay::new(db.pool.clone(), kafka.bootstrap_servers()).unwrap();
    let done = replay
        .run(
            &ReplayFilter::topic(TOPIC),
            Some("customer.rebuild"),
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(done.published, 3);
    let replayed = kafka.records("customer.rebuild").await.unwrap();
    assert_eq!(versions(&replayed), versions(&records));
}

/// The three versions relayed, and a record whose version header is not a number, consumed in
/// `mode` by [`rename`] with an upcaster from version 1. Returns the database and the broker
/// once every message was dealt with: names written for versions 1 and 2.
async fn consumed_in(mode: Mode) -> (TestDb, MockKafka, [Uuid; 3], Uuid) {
    let db = TestDb::new().await;
    create_names(&db.pool).await;
    let ids = emit_three_versions(&db.pool).await;
    let kafka = MockKafka::start().unwrap();
    kafka.create_topic(TOPIC, 1).unwrap();
    kafka.create_topic(&format!("{TOPIC}.retry"), 1).unwrap();
    kafka.create_topic(&format!("{TOPIC}.dlq"), 1).unwrap();
    assert_eq!(kafka.relay_pending(&db.pool).await.unwrap(), 3);
    let garbled_id = Uuid::now_v7();
    let mut garbled = Outgoing::event(
        &CustomerRenamed {
            customer_id: Uuid::now_v7(),
            first_name: "x".into(),
            last_name: "y".into(),
        },
        garbled_id,
    );
    garbled
        .headers
        .push((SCHEMA_VERSION_HEADER.into(), "two".into()));
    produce(kafka.bootstrap_servers(), TOPIC, &[garbled]).await;

    let consumer = Consumer::builder(db.pool.clone())
        .brokers(kafka.bootstrap_servers())
        .group_id("crm")
        .handler(rename)
        .upcast::<CustomerRenamed, _>(1, upcast_v1)
        .mode(mode)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    let pool = db.pool.clone();
    wait_for("two names written", Duration::from_secs(30), || async {
        count(&pool, "SELECT count(*) FROM names").await == 2
    })
    .await;
    if mode == Mode::Inbox {
        wait_for("one dead inbox row", Duration::from_secs(30), || async {
            count(
                &pool,
                "SELECT count(*) FROM inbox_event WHERE dead_at IS NOT NULL",
            )
            .await
                == 1
        })
        .await;
    }
    running.stop().await;
    (db, kafka, ids, garbled_id)
}

/// The names written: (first, last, version sent), by version.
async fn names(pool: &PgPool) -> Vec<(String, String, i32)> {
    sqlx::query_as("SELECT first_name, last_name, version FROM names ORDER BY version")
        .fetch_all(pool)
        .await
        .unwrap()
}

fn expected_names() -> Vec<(String, String, i32)> {
    vec![
        ("Ada".into(), "Lovelace".into(), 1),
        ("Grace".into(), "Hopper".into(), 2),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_mode_upcasts_an_older_version_and_dead_letters_an_unknown_one_saying_why() {
    let (db, kafka, [_, _, v3], garbled) = consumed_in(Mode::Dedup).await;
    assert_eq!(names(&db.pool).await, expected_names());
    let dead = consume(
        kafka.bootstrap_servers(),
        &format!("{TOPIC}.dlq"),
        1,
        Duration::from_secs(30),
        |r| r.len() >= 2,
    )
    .await;
    assert_eq!(dead.len(), 2);
    let reason = |id: Uuid| {
        dead.iter()
            .find(|r| r.header("event_id") == id.to_string())
            .map(|r| r.header("dlq_error").to_owned())
            .unwrap_or_else(|| panic!("{id} is a dead letter"))
    };
    let v3_reason = reason(v3);
    assert!(
        v3_reason
            .contains("schema version 3 of `CustomerRenamed` is not accepted by handler `rename`")
            && v3_reason.contains("no upcaster from version 3"),
        "{v3_reason}"
    );
    // The dead letter keeps its version header, for whoever reads it.
    let v3_record = dead
        .iter()
        .find(|r| r.header("event_id") == v3.to_string())
        .unwrap();
    assert_eq!(v3_record.header(SCHEMA_VERSION_HEADER), "3");
    let garbled_reason = reason(garbled);
    assert!(
        garbled_reason.contains("outbox_schema_version header is not a positive integer"),
        "{garbled_reason}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_mode_stores_the_version_upcasts_and_marks_an_unknown_one_dead() {
    let (db, _kafka, [v1, v2, v3], garbled) = consumed_in(Mode::Inbox).await;
    assert_eq!(names(&db.pool).await, expected_names());
    let rows: Vec<(Uuid, i64, bool, Option<String>)> = sqlx::query_as(
        "SELECT event_id, schema_version, dead_at IS NOT NULL, last_error FROM inbox_event \
         ORDER BY schema_version",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let summary: Vec<(Uuid, i64, bool)> = rows.iter().map(|r| (r.0, r.1, r.2)).collect();
    assert_eq!(summary, [(v1, 1, false), (v2, 2, false), (v3, 3, true)]);
    let error = rows[2].3.clone().unwrap();
    assert!(error.contains("schema version 3"), "{error}");
    // The garbled one never reached the inbox: it is a dead letter at receipt.
    assert!(!rows.iter().any(|r| r.0 == garbled));
    // And the inbox rows keep the application's headers, not the version's.
    assert_eq!(
        stored_headers(&db.pool, "inbox_event", v2).await,
        json!({"tenant": "acme"})
    );
}

/// Version 2 with `#[serde(default)]`: reads version 1 payloads too (without `nickname`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(
    topic = "customer.events",
    aggregate_type = "Customer",
    event_type = "CustomerSeen",
    version = 2
)]
struct CustomerSeen {
    #[outbox(aggregate_id)]
    customer_id: Uuid,
    #[serde(default)]
    nickname: Option<String>,
}

#[inbox_handler(versions = [1, 2])]
async fn note_seen(event: CustomerSeen, tx: &mut PgConnection) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO names (customer_id, first_name, last_name, version) VALUES ($1, $2, '', 0)",
    )
    .bind(event.customer_id)
    .bind(event.nickname.unwrap_or_default())
    .execute(tx)
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_handler_takes_the_versions_it_declares_and_no_other() {
    assert!(Handler::<()>::accepts_version(&note_seen, 1));
    assert!(Handler::<()>::accepts_version(&note_seen, 2));
    assert!(!Handler::<()>::accepts_version(&note_seen, 3));
    // Without a declaration, only the event's own.
    assert!(Handler::<()>::accepts_version(&rename, 2));
    assert!(!Handler::<()>::accepts_version(&rename, 1));

    let db = TestDb::new().await;
    create_names(&db.pool).await;
    let event = CustomerSeen {
        customer_id: Uuid::now_v7(),
        nickname: Some("Bob".into()),
    };
    let deliver = |version: u32| {
        let (pool, event) = (db.pool.clone(), event.clone());
        async move {
            let id = Uuid::now_v7();
            let meta = MessageMeta::new(id, "CustomerSeen", TOPIC).with_schema_version(version);
            testing::deliver_with(&pool, "crm", note_seen, (), &meta, &event)
                .await
                .unwrap()
        }
    };
    match deliver(3).await {
        Delivery::Failed { retryable, reason } => {
            assert!(!retryable);
            assert!(
                reason.contains(
                    "schema version 3 of `CustomerSeen` is not accepted by handler `note_seen`"
                ),
                "{reason}"
            );
        }
        other => panic!("version 3 was {other:?}"),
    }
    assert_eq!(deliver(1).await, Delivery::Handled);
    assert_eq!(count(&db.pool, "SELECT count(*) FROM names").await, 1);
}

#[tokio::test]
async fn build_refuses_upcasters_it_could_never_use() {
    let db = TestDb::new().await;
    let build = |f: fn(ConsumerBuilder) -> ConsumerBuilder| {
        let builder = Consumer::builder(db.pool.clone())
            .brokers("localhost:9092")
            .group_id("crm")
            .handler(rename);
        f(builder).build().err().map(|e| e.to_string())
    };
    let error = |f| build(f).expect("build refuses it");
    assert!(build(|b| b.upcast::<CustomerRenamed, _>(1, upcast_v1)).is_none());
    assert!(error(|b| b.upcast::<CustomerRenamed, _>(0, upcast_v1)).contains("from version 0"));
    assert!(error(|b| b.upcast::<CustomerRenamed, _>(2, upcast_v1)).contains("its own version"));
    assert!(error(|b| b
        .upcast::<CustomerRenamed, _>(1, upcast_v1)
        .upcast::<CustomerRenamed, _>(1, upcast_v1))
    .contains("two upcasters to"));
    let unused = error(|b| b.upcast::<CustomerSeen, _>(1, |_| Err("never called".into())));
    assert!(unused.contains("no handler takes"), "{unused}");
    // `note_seen` takes versions 1 and 2 itself: an upcaster from 1 would never run.
    let shadowed = Consumer::builder(db.pool.clone())
        .brokers("localhost:9092")
        .group_id("crm")
        .handler(note_seen)
        .upcast::<CustomerSeen, _>(1, |_| Err("never called".into()))
        .build()
        .err()
        .map(|e| e.to_string())
        .expect("build refuses an upcaster every handler bypasses");
    assert!(
        shadowed.contains("every handler of `") && shadowed.contains("takes version 1 itself"),
        "{shadowed}"
    );
    // One handler that does not take version 1 is enough for it to be used.
    assert!(Consumer::builder(db.pool.clone())
        .brokers("localhost:9092")
        .group_id("crm")
        .handler(note_seen)
        .handler(seen_v2_only)
        .upcast::<CustomerSeen, _>(1, |_| Err("called".into()))
        .build()
        .is_ok());
}

/// Takes [`CustomerSeen`]'s own version only.
#[inbox_handler]
async fn seen_v2_only(_event: CustomerSeen, _tx: &mut PgConnection) -> Result<(), HandlerError> {
    Ok(())
}

#[tokio::test]
async fn the_test_kit_delivers_an_event_as_its_own_schema_version() {
    let db = TestDb::new().await;
    create_names(&db.pool).await;
    let event = CustomerRenamed {
        customer_id: Uuid::now_v7(),
        first_name: "Grace".into(),
        last_name: "Hopper".into(),
    };
    let delivery = testing::deliver(&db.pool, "crm", rename, Uuid::now_v7(), &event)
        .await
        .unwrap();
    assert_eq!(delivery, Delivery::Handled);
    assert_eq!(
        names(&db.pool).await,
        [("Grace".to_owned(), "Hopper".to_owned(), 2)]
    );
}
