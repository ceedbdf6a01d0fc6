//! What a handler gets besides its event: the consumer's application state and the message's
//! metadata (event id and type, topic, partition, offset, key, application headers, attempt),
//! in every mode; and hand-written handlers whose name is per instance.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_runtime::inbox::{BoxFuture, Handler, HandlerError, MessageMeta, Mode, RetryPolicy};
use outbox_runtime::inbox_handler;
use outbox_tests::fixtures::{PaymentSucceeded, PAYMENTS};
use outbox_tests::kafka::{consume, produce, Received};
use outbox_tests::payments::{builder, orders_with_payments, paid_counts, setup, wait_for};
use outbox_tests::payments::{records, retried, PARTITIONS};
use outbox_tests::{count, Running};
use sqlx::PgConnection;
use uuid::Uuid;

/// What a handler saw of one call.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    event_id: Uuid,
    event_type: String,
    topic: String,
    partition: Option<i32>,
    offset: Option<i64>,
    key: Option<String>,
    headers: Vec<(String, String)>,
    attempt: u32,
}

/// The application state of these tests: where the handler records what it saw (the test
/// keeps a clone of the list).
struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
}

/// Records its call, fails each event's first attempt (retryably), then marks the order paid.
#[inbox_handler]
async fn record_and_pay(
    event: PaymentSucceeded,
    tx: &mut PgConnection,
    recorder: &Recorder,
    meta: &MessageMeta,
) -> Result<(), HandlerError> {
    recorder.seen.lock().unwrap().push(Seen {
        event_id: meta.event_id(),
        event_type: meta.event_type().to_owned(),
        topic: meta.topic().to_owned(),
        partition: meta.partition(),
        offset: meta.offset(),
        key: meta.key().map(str::to_owned),
        headers: meta
            .headers()
            .iter()
            .map(|(n, v)| ((*n).to_owned(), String::from_utf8_lossy(v).into_owned()))
            .collect(),
        attempt: meta.attempt(),
    });
    if meta.attempt() == 1 {
        return Err(HandlerError::retryable("first attempts fail"));
    }
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    Ok(())
}

/// Three payments with application headers (`tenant`, `trace`), produced as the relay would,
/// handled by [`record_and_pay`] in `mode`: what it saw, the records as produced, and what
/// went to the retry topic.
async fn handled_in(mode: Mode, policy: RetryPolicy) -> (Vec<Seen>, Vec<Received>, Vec<Received>) {
    let (db, kafka) = setup().await;
    let payments = orders_with_payments(&db.pool, 3).await;
    let mut outgoing = records(&payments);
    for (i, record) in outgoing.iter_mut().enumerate() {
        record.headers.push(("tenant".into(), format!("t-{i}")));
        record.headers.push(("trace".into(), "abc".into()));
    }
    produce(&kafka.bootstrap(), PAYMENTS, &outgoing).await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let consumer = builder(&db, &kafka, "orders")
        .state(Recorder {
            seen: Arc::clone(&seen),
        })
        .handler(record_and_pay)
        .mode(mode)
        .retry_policy(policy)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for("every order paid", Duration::from_secs(30), || async {
        paid_counts(&db.pool).await == [1, 1, 1]
    })
    .await;
    running.stop().await;
    let produced = consume(
        &kafka.bootstrap(),
        PAYMENTS,
        PARTITIONS,
        Duration::from_secs(10),
        |r| r.len() == 3,
    )
    .await;
    assert_eq!(produced.len(), 3);
    let expected = if (mode, policy) == (Mode::Dedup, RetryPolicy::Topic) {
        3
    } else {
        0
    };
    let retried = retried(&kafka, expected).await;
    assert_eq!(retried.len(), expected);
    let seen = seen.lock().unwrap().clone();
    (seen, produced, retried)
}

/// Checks what the handler saw of each produced record: its first attempt (`1`) exactly as
/// produced, and its last (`2`), whose partition and offset `retried_at` gives (or `None`: the
/// same as the first's).
fn check(seen: &[Seen], produced: &[Received], retried_at: Option<&[Received]>) {
    for record in produced {
        let event_id: Uuid = record.header("event_id").parse().unwrap();
        let calls: Vec<&Seen> = seen.iter().filter(|s| s.event_id == event_id).collect();
        let first = calls
            .iter()
            .find(|s| s.attempt == 1)
            .expect("a first attempt");
        assert_eq!(
            **first,
            Seen {
                event_id,
                event_type: "PaymentSucceeded".into(),
                topic: PAYMENTS.into(),
                partition: Some(record.partition),
                offset: Some(record.offset),
                key: Some(record.key.clone()),
                headers: vec![
                    ("tenant".into(), record.header("tenant").into()),
                    ("trace".into(), "abc".into()),
                ],
                attempt: 1,
            },
            "the framework's own headers are not the application's"
        );
        let last = calls.iter().max_by_key(|s| s.attempt).unwrap();
        assert_eq!(last.attempt, 2, "{calls:?}");
        let (partition, offset) = match retried_at {
            None => (record.partition, record.offset),
            Some(retries) => {
                let retry = retries
                    .iter()
                    .find(|r| r.header("event_id") == event_id.to_string())
                    .expect("sent to the retry topic");
                (retry.partition, retry.offset)
            }
        };
        assert_eq!(
            (last.topic.as_str(), last.partition, last.offset),
            (PAYMENTS, Some(partition), Some(offset)),
            "a retried message is routed by its source topic, read at its retry's offset"
        );
        assert_eq!(last.headers, first.headers, "headers survive the retry");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_handlers_get_state_and_metadata_through_the_retry_topic() {
    let (seen, produced, retried) = handled_in(Mode::Dedup, RetryPolicy::Topic).await;
    check(&seen, &produced, Some(&retried));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_handlers_get_state_and_metadata_retried_in_place() {
    let (seen, produced, _) = handled_in(Mode::Dedup, RetryPolicy::InPlace).await;
    check(&seen, &produced, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_handlers_get_state_and_metadata_from_the_stored_row() {
    let (seen, produced, _) = handled_in(Mode::Inbox, RetryPolicy::Topic).await;
    check(&seen, &produced, None);
}

/// A handler written by hand, configured per instance: its name is its ledger.
struct Book {
    ledger: &'static str,
}

impl Handler<Rates> for Book {
    type Event = PaymentSucceeded;

    fn name(&self) -> &str {
        self.ledger
    }

    fn handle<'a>(
        &'a self,
        event: PaymentSucceeded,
        tx: &'a mut PgConnection,
        rates: &'a Rates,
        meta: &'a MessageMeta<'a>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            sqlx::query(
                "INSERT INTO book (ledger, order_id, amount, event_id) VALUES ($1, $2, $3, $4)",
            )
            .bind(self.ledger)
            .bind(event.order_id)
            .bind(event.amount * rates.factor)
            .bind(meta.event_id())
            .execute(tx)
            .await?;
            Ok(())
        })
    }
}

struct Rates {
    factor: i64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_of_one_handler_type_are_two_handlers() {
    let (db, kafka) = setup().await;
    sqlx::query(
        "CREATE TABLE book (ledger text, order_id uuid, amount bigint, event_id uuid, \
         PRIMARY KEY (ledger, order_id))",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // The same name twice is refused, naming it.
    let refused = builder(&db, &kafka, "accounting")
        .state(Rates { factor: 3 })
        .handler(Book { ledger: "sales" })
        .handler(Book { ledger: "sales" })
        .build()
        .unwrap_err();
    assert!(
        refused
            .to_string()
            .contains("handler `sales` is registered twice"),
        "{refused}"
    );

    let payments = orders_with_payments(&db.pool, 2).await;
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
    let consumer = builder(&db, &kafka, "accounting")
        .state(Rates { factor: 3 })
        .handler(Book { ledger: "sales" })
        .handler(Book { ledger: "tax" })
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for("both ledgers booked", Duration::from_secs(30), || async {
        count(&db.pool, "SELECT count(*) FROM book").await == 4
    })
    .await;
    running.stop().await;
    let mut booked: Vec<(String, Uuid, i64, Uuid)> =
        sqlx::query_as("SELECT ledger, order_id, amount, event_id FROM book")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    booked.sort();
    let mut expected: Vec<(String, Uuid, i64, Uuid)> = payments
        .iter()
        .flat_map(|(id, p)| {
            ["sales", "tax"].map(|ledger| (ledger.to_owned(), p.order_id, p.amount * 3, *id))
        })
        .collect();
    expected.sort();
    assert_eq!(
        booked, expected,
        "each instance ran once per event, with the state"
    );
    // Each instance has its own deduplication rows.
    let mut keys: Vec<String> = sqlx::query_scalar("SELECT DISTINCT handler FROM processed_event")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    keys.sort();
    assert_eq!(keys, ["accounting/sales", "accounting/tax"]);
}
