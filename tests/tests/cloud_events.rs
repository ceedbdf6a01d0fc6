//! CloudEvents, Kafka protocol binding, binary content mode, both ways: the relay writes the
//! required attributes (`specversion`, `id`, `source`, `type`) and `time`, `subject`,
//! `datacontenttype` on the topics it is told to; a consumer reads a CloudEvent from another
//! producer (no `event_id`/`event_type` headers) by its `ce_id` and `ce_type`.

use std::time::Duration;

use outbox_runtime::admin::{Replay, ReplayFilter};
use outbox_runtime::inbox::{Consumer, HandlerError, MessageMeta, Mode};
use outbox_runtime::relay::{CloudEvents, Relay};
use outbox_runtime::testing::{MockKafka, Record};
use outbox_runtime::{inbox_handler, Error, OutboxEvent, Uow};
use outbox_tests::fixtures::{posted, PaymentSucceeded, Posted};
use outbox_tests::kafka::{consume, produce, Outgoing};
use outbox_tests::payments::wait_for;
use outbox_tests::{count, Running, TestDb};
use sqlx::PgConnection;
use uuid::Uuid;

/// The CloudEvents attribute headers of a record (`ce_*`), by name.
fn attributes(record: &Record) -> Vec<(&str, &str)> {
    record
        .headers
        .iter()
        .filter(|(k, _)| k.starts_with("ce_"))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// Checks a record against the binding: the required attributes present and non-empty,
/// `specversion` 1.0, attribute names of lowercase letters and digits, `time` RFC 3339.
fn check_required(record: &Record) {
    let attrs = attributes(record);
    for required in ["ce_specversion", "ce_id", "ce_source", "ce_type"] {
        let value = attrs.iter().find(|(k, _)| *k == required).map(|(_, v)| *v);
        assert!(
            value.is_some_and(|v| !v.is_empty()),
            "{required} missing or empty in {attrs:?}"
        );
    }
    assert_eq!(record.header("ce_specversion"), Some("1.0"));
    for (name, _) in &attrs {
        let attribute = &name["ce_".len()..];
        assert!(
            !attribute.is_empty()
                && attribute
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()),
            "`{name}` is not a CloudEvents attribute name"
        );
    }
    let time = record.header("ce_time").expect("ce_time");
    chrono::DateTime::parse_from_rfc3339(time).expect("ce_time is RFC 3339");
    assert_eq!(record.header("content-type"), Some("application/json"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_writes_cloudevents_on_the_topics_it_covers_and_a_replay_too() {
    let db = TestDb::new().await;
    let entry = posted("L-1");
    let payment = PaymentSucceeded {
        payment_id: Uuid::now_v7(),
        order_id: Uuid::now_v7(),
        amount: 5,
    };
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit_with(&entry, [("ce_tenant", "acme")])
        .await
        .unwrap();
    let payment_id = uow.emit(&payment).await.unwrap();
    uow.commit().await.unwrap();
    // `ce_*` attributes the relay writes are the framework's; others are extensions.
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    let refused = uow.emit_with(&posted("L-2"), [("ce_id", "x")]).await;
    assert!(
        matches!(&refused, Err(Error::InvalidEvent { reason, .. }) if reason.contains("`ce_id` is reserved")),
        "{refused:?}"
    );
    drop(uow);

    let kafka = MockKafka::start().unwrap();
    kafka.create_topic(Posted::TOPIC, 1).unwrap();
    kafka.create_topic(PaymentSucceeded::TOPIC, 1).unwrap();
    kafka.create_topic("ledger.rebuild", 1).unwrap();
    let ce = CloudEvents::new("/ledger-service").topics([Posted::TOPIC]);
    let relay = Relay::builder(db.pool.clone())
        .brokers(kafka.bootstrap_servers())
        .cloud_events(ce.clone())
        .build()
        .unwrap();
    assert_eq!(relay.publish_pending().await.unwrap(), 2);

    let created_ms: i64 = sqlx::query_scalar(
        "SELECT (extract(epoch FROM created_at) * 1000)::int8 FROM outbox_event WHERE event_id = $1",
    )
    .bind(entry.id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let check = |record: &Record| {
        check_required(record);
        let id = entry.id.to_string();
        assert_eq!(record.header("ce_id"), Some(id.as_str()));
        assert_eq!(record.header("ce_source"), Some("/ledger-service"));
        assert_eq!(record.header("ce_type"), Some(Posted::EVENT_TYPE));
        assert_eq!(record.header("ce_subject"), Some("L-1"));
        assert_eq!(record.header("ce_tenant"), Some("acme"));
        // And the framework's own, for this crate's consumers.
        assert_eq!(record.header("event_id"), Some(id.as_str()));
    };
    let ledger = kafka.records(Posted::TOPIC).await.unwrap();
    assert_eq!(ledger.len(), 1);
    check(&ledger[0]);
    let time = chrono::DateTime::parse_from_rfc3339(ledger[0].header("ce_time").unwrap()).unwrap();
    assert!(
        (time.timestamp_millis() - created_ms).abs() <= 1,
        "{time} vs {created_ms} ms"
    );
    // A topic it does not cover keeps the plain format.
    let payments = kafka.records(PaymentSucceeded::TOPIC).await.unwrap();
    assert_eq!(payments.len(), 1);
    assert_eq!(
        payments[0].header("event_id"),
        Some(payment_id.to_string().as_str())
    );
    assert_eq!(attributes(&payments[0]), []);

    // A replay given the relay's setting writes them too (to another topic: every topic is
    // covered by a setting without a list).
    let replay = Replay::new(db.pool.clone(), kafka.bootstrap_servers())
        .unwrap()
        .cloud_events(CloudEvents::new("/ledger-service"))
        .unwrap();
    let done = replay
        .run(
            &ReplayFilter::topic(Posted::TOPIC),
            Some("ledger.rebuild"),
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(done.published, 1);
    let replayed = &kafka.records("ledger.rebuild").await.unwrap()[0];
    check(replayed);
    // `time` is when the event happened, not when it was replayed.
    assert_eq!(replayed.header("ce_time"), ledger[0].header("ce_time"));

    // Settings that cannot be right are refused.
    let build = |ce: CloudEvents| {
        Relay::builder(db.pool.clone())
            .brokers(kafka.bootstrap_servers())
            .cloud_events(ce)
            .build()
            .unwrap_err()
            .to_string()
    };
    assert!(build(CloudEvents::new("")).contains("source must not be empty"));
    assert!(build(CloudEvents::new("/a b")).contains("not a URI reference"));
    assert!(build(CloudEvents::new("/a").topics(Vec::<String>::new())).contains("empty list"));
}

/// Records the id, type and CloudEvents source and id each posting was handled under.
#[inbox_handler]
async fn note(
    event: Posted,
    tx: &mut PgConnection,
    meta: &MessageMeta,
) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO noted (event_id, event_type, ledger, source, ce_id) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(meta.event_id())
    .bind(meta.event_type())
    .bind(&event.ledger)
    .bind(meta.header("ce_source"))
    .bind(meta.header("ce_id"))
    .execute(tx)
    .await?;
    Ok(())
}

/// A CloudEvent as another producer writes it: only `ce_*` headers and `content-type`.
fn foreign(ce_id: &str, source: &str, spec: Option<&str>, ledger: &str) -> Outgoing {
    let mut headers = vec![
        ("ce_id".to_owned(), ce_id.to_owned()),
        ("ce_source".to_owned(), source.to_owned()),
        ("ce_type".to_owned(), Posted::EVENT_TYPE.to_owned()),
        ("content-type".to_owned(), "application/json".to_owned()),
    ];
    if let Some(spec) = spec {
        headers.push(("ce_specversion".to_owned(), spec.to_owned()));
    }
    Outgoing {
        key: ledger.to_owned(),
        payload: serde_json::to_vec(&posted(ledger)).unwrap(),
        headers,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedup_consumer_reads_another_producers_cloudevents_by_ce_id_and_ce_type() {
    reads_another_producers_cloudevents(Mode::Dedup).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_consumer_reads_another_producers_cloudevents_by_ce_id_and_ce_type() {
    reads_another_producers_cloudevents(Mode::Inbox).await;
}

async fn reads_another_producers_cloudevents(mode: Mode) {
    let db = TestDb::new().await;
    sqlx::query(
        "CREATE TABLE noted (event_id uuid, event_type text, ledger text, source text, \
         ce_id text)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let kafka = MockKafka::start().unwrap();
    for topic in [Posted::TOPIC, "ledger.events.retry", "ledger.events.dlq"] {
        kafka.create_topic(topic, 1).unwrap();
    }
    let uuid_id = Uuid::new_v4();
    let records = [
        foreign("order-42", "/billing", Some("1.0"), "L-1"),
        // Delivered again: the same event.
        foreign("order-42", "/billing", Some("1.0"), "L-1"),
        // The same id from another source: another event.
        foreign("order-42", "/shipping", Some("1.0"), "L-2"),
        // A UUID id is the event id itself.
        foreign(&uuid_id.to_string(), "/billing", Some("1.0"), "L-3"),
        // Not a CloudEvent this consumer can read: a dead letter.
        foreign("order-43", "/billing", None, "L-4"),
        // Another spelling of that UUID is another id (ids are compared as strings).
        foreign(
            &uuid_id.simple().to_string().to_uppercase(),
            "/billing",
            Some("1.0"),
            "L-5",
        ),
        // `type` is required: a dead letter too.
        without_type(foreign("order-44", "/billing", Some("1.0"), "L-6")),
    ];
    produce(kafka.bootstrap_servers(), Posted::TOPIC, &records).await;
    let consumer = Consumer::builder(db.pool.clone())
        .brokers(kafka.bootstrap_servers())
        .group_id("ledger-reader")
        .handler(note)
        .mode(mode)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    let dead = consume(
        kafka.bootstrap_servers(),
        "ledger.events.dlq",
        1,
        Duration::from_secs(30),
        |r| r.len() >= 2,
    )
    .await;
    let pool = db.pool.clone();
    wait_for("four postings noted", Duration::from_secs(30), || async {
        count(&pool, "SELECT count(*) FROM noted").await >= 4
    })
    .await;
    running.stop().await;

    let noted: Vec<Noted> = sqlx::query_as(
        "SELECT event_id, event_type, ledger, source, ce_id FROM noted ORDER BY ledger",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let ledgers: Vec<&str> = noted.iter().map(|n| n.2.as_str()).collect();
    assert_eq!(
        ledgers,
        ["L-1", "L-2", "L-3", "L-5"],
        "the redelivery was not handled twice"
    );
    assert!(noted.iter().all(|n| n.1 == Posted::EVENT_TYPE));
    assert_ne!(noted[0].0, noted[1].0, "ids are per source");
    assert_eq!(noted[2].0, uuid_id);
    assert_ne!(noted[3].0, uuid_id, "another ce_id, another event");
    // The handler reads the CloudEvent's attributes, the id as sent too.
    let attributes: Vec<(Option<&str>, Option<&str>)> = noted
        .iter()
        .map(|n| (n.3.as_deref(), n.4.as_deref()))
        .collect();
    let upper = uuid_id.simple().to_string().to_uppercase();
    let uuid_text = uuid_id.to_string();
    assert_eq!(
        attributes,
        [
            (Some("/billing"), Some("order-42")),
            (Some("/shipping"), Some("order-42")),
            (Some("/billing"), Some(uuid_text.as_str())),
            (Some("/billing"), Some(upper.as_str())),
        ]
    );
    assert_eq!(dead.len(), 2);
    let reason = |ce_id: &str| {
        dead.iter()
            .find(|r| r.header("ce_id") == ce_id)
            .map(|r| r.header("dlq_error").to_owned())
            .unwrap_or_else(|| panic!("{ce_id} is a dead letter"))
    };
    let no_spec = reason("order-43");
    assert!(no_spec.contains("ce_specversion is required"), "{no_spec}");
    let no_type = reason("order-44");
    assert!(no_type.contains("ce_type"), "{no_type}");
}

/// A row of `noted`: event id, event type, ledger, and the CloudEvents source and id as sent.
type Noted = (Uuid, String, String, Option<String>, Option<String>);

/// `record` without its `ce_type` header.
fn without_type(mut record: Outgoing) -> Outgoing {
    record.headers.retain(|(name, _)| name != "ce_type");
    record
}
