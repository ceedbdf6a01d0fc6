//! The unit of work against a real PostgreSQL: atomic emit, rollback, bad input, concurrency,
//! batching.

use std::collections::{BTreeMap, HashSet};

use outbox_runtime::{Error, IntoRecord, OutboxEvent, OutboxRecord, Uow};
use outbox_tests::fixtures::OrderCreated;
use outbox_tests::proxy::Proxy;
use outbox_tests::{count, TestDb};
use serde::Serialize;
use sqlx::{PgPool, Row};
use uuid::Uuid;

#[derive(Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
struct OrderLineAdded {
    #[outbox(aggregate_id)]
    order_id: Uuid,
    #[outbox(key)]
    customer: String,
    sku: String,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(topic = "payment.events", aggregate_type = "Payment")]
struct PaymentRequested {
    #[outbox(event_id)]
    id: Uuid,
    #[outbox(aggregate_id)]
    payment_id: u64,
}

/// A payload serde_json refuses: map keys must be strings.
#[derive(Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
struct Unserializable {
    #[outbox(aggregate_id)]
    order_id: Uuid,
    totals: BTreeMap<(u8, u8), i64>,
}

async fn setup() -> TestDb {
    let db = TestDb::new().await;
    sqlx::query(
        "CREATE TABLE orders (id uuid PRIMARY KEY, customer_id uuid NOT NULL, \
         amount bigint NOT NULL CHECK (amount > 0))",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    db
}

fn order(amount: i64) -> OrderCreated {
    OrderCreated {
        order_id: Uuid::now_v7(),
        customer_id: Uuid::now_v7(),
        amount,
    }
}

/// The command handler under test: a domain row and its event in one unit of work.
async fn place_order(uow: &mut Uow<'_>, event: &OrderCreated) -> outbox_runtime::Result<Uuid> {
    sqlx::query("INSERT INTO orders (id, customer_id, amount) VALUES ($1, $2, $3)")
        .bind(event.order_id)
        .bind(event.customer_id)
        .bind(event.amount)
        .execute(uow.tx())
        .await?;
    uow.emit(event).await
}

async fn assert_empty(pool: &PgPool) {
    assert_eq!(
        count(pool, "SELECT count(*) FROM orders").await,
        0,
        "no domain row may remain"
    );
    assert_eq!(
        count(pool, "SELECT count(*) FROM outbox_event").await,
        0,
        "no outbox row may remain"
    );
}

#[tokio::test]
async fn commit_writes_domain_row_and_outbox_row() {
    let db = setup().await;
    let event = order(4200);
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    let event_id = place_order(&mut uow, &event).await.unwrap();
    assert_eq!(uow.emitted(), 1);
    uow.commit().await.unwrap();

    let amount: i64 = sqlx::query_scalar("SELECT amount FROM orders WHERE id = $1")
        .bind(event.order_id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(amount, 4200);

    let row = sqlx::query(
        "SELECT event_id, topic, partition_key, aggregate_type, aggregate_id, event_type, \
         payload, published_at IS NULL AS unpublished, created_at <= now() AS created \
         FROM outbox_event",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(row.get::<Uuid, _>("event_id"), event_id);
    assert_eq!(
        event_id.get_version_num(),
        7,
        "generated event ids are UUIDv7"
    );
    assert_eq!(row.get::<String, _>("topic"), "order.events");
    assert_eq!(
        row.get::<String, _>("partition_key"),
        event.order_id.to_string()
    );
    assert_eq!(row.get::<String, _>("aggregate_type"), "Order");
    assert_eq!(
        row.get::<String, _>("aggregate_id"),
        event.order_id.to_string()
    );
    assert_eq!(row.get::<String, _>("event_type"), "OrderCreated");
    assert_eq!(
        row.get::<serde_json::Value, _>("payload"),
        serde_json::json!({
            "order_id": event.order_id,
            "customer_id": event.customer_id,
            "amount": 4200,
        })
    );
    assert!(row.get::<bool, _>("unpublished"));
    assert!(row.get::<bool, _>("created"));
}

#[tokio::test]
async fn explicit_rollback_leaves_neither_row() {
    let db = setup().await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    place_order(&mut uow, &order(1)).await.unwrap();
    uow.rollback().await.unwrap();
    assert_empty(&db.pool).await;
}

#[tokio::test]
async fn drop_without_commit_leaves_neither_row() {
    let db = setup().await;
    {
        let mut uow = Uow::begin(&db.pool).await.unwrap();
        place_order(&mut uow, &order(1)).await.unwrap();
    }
    assert_empty(&db.pool).await;
}

#[tokio::test]
async fn failing_domain_statement_leaves_neither_row() {
    let db = setup().await;
    let handler = async {
        let mut uow = Uow::begin(&db.pool).await?;
        let good = order(10);
        uow.emit(&good).await?;
        // The CHECK constraint fails: the handler returns early and the unit of work drops.
        place_order(&mut uow, &order(-5)).await?;
        uow.commit().await
    };
    let err = handler.await.unwrap_err();
    assert!(err.to_string().contains("orders_amount_check"), "{err}");
    assert_empty(&db.pool).await;
}

/// Emits `events` in a unit of work after a domain insert, expects the emit to fail, then shows
/// that `commit` refuses and that nothing was written. Returns the emit's error.
async fn assert_emit_fails<I>(db: &TestDb, events: I) -> Error
where
    I: IntoIterator,
    I::Item: IntoRecord,
{
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    place_order(&mut uow, &order(7)).await.unwrap();
    let err = uow.emit_all(events).await.unwrap_err();
    // Even an application that ignores the error cannot commit the domain row alone.
    let again = uow.emit(&order(8)).await.unwrap_err();
    assert!(matches!(again, Error::EmitFailedEarlier { .. }), "{again}");
    let refused = uow.commit().await.unwrap_err();
    assert!(
        matches!(&refused, Error::EmitFailedEarlier { first_error } if *first_error == outbox_runtime::error_chain(&err).to_string()),
        "{refused}"
    );
    assert_eq!(count(&db.pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM outbox_event").await,
        0
    );
    err
}

#[tokio::test]
async fn empty_partition_key_is_an_error_naming_the_event_type() {
    let db = setup().await;
    let event = OrderLineAdded {
        order_id: Uuid::now_v7(),
        customer: String::new(),
        sku: "A-1".into(),
    };
    let err = assert_emit_fails(&db, [&event]).await;
    assert!(matches!(err, Error::InvalidEvent { .. }));
    assert_eq!(
        err.to_string(),
        "cannot emit `OrderLineAdded`: partition key is empty"
    );
    // `emit` of one event reports the same.
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    assert_eq!(
        uow.emit(&event).await.unwrap_err().to_string(),
        err.to_string()
    );
}

#[tokio::test]
async fn empty_aggregate_id_is_an_error_naming_the_event_type() {
    #[derive(Serialize, OutboxEvent)]
    #[outbox(topic = "customer.events", aggregate_type = "Customer")]
    struct CustomerRenamed {
        #[outbox(aggregate_id)]
        customer: String,
        #[outbox(key)]
        region: &'static str,
    }
    let db = setup().await;
    let event = CustomerRenamed {
        customer: String::new(),
        region: "eu",
    };
    let err = assert_emit_fails(&db, [&event]).await;
    assert_eq!(
        err.to_string(),
        "cannot emit `CustomerRenamed`: aggregate id is empty"
    );
}

#[tokio::test]
async fn payload_that_fails_to_serialize_is_an_error_naming_the_event_type() {
    let db = setup().await;
    let event = Unserializable {
        order_id: Uuid::now_v7(),
        totals: BTreeMap::from([((1, 2), 3)]),
    };
    let err = assert_emit_fails(&db, [&event]).await;
    assert!(matches!(err, Error::Payload { .. }));
    let msg = outbox_runtime::error_chain(&err).to_string();
    assert!(
        msg.starts_with("cannot emit `Unserializable`: its payload does not serialize to JSON: key must be a string"),
        "{msg}"
    );
}

/// Two events with the same event id break the UNIQUE constraint on `event_id`.
fn clashing_payments() -> [PaymentRequested; 2] {
    let id = Uuid::now_v7();
    [
        PaymentRequested { id, payment_id: 1 },
        PaymentRequested { id, payment_id: 2 },
    ]
}

#[tokio::test]
async fn database_error_at_commit_names_the_event_type_and_commits_nothing() {
    let db = setup().await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    place_order(&mut uow, &order(7)).await.unwrap();
    uow.emit_all(&clashing_payments()).await.unwrap();
    let err = uow.commit().await.unwrap_err();
    assert!(matches!(err, Error::Commit { .. }), "{err}");
    let msg = outbox_runtime::error_chain(&err).to_string();
    assert!(
        msg.starts_with(
            "unit of work not committed (it emitted `OrderCreated`, `PaymentRequested`): "
        ),
        "{msg}"
    );
    assert!(msg.contains("outbox_event_event_id_key"), "{msg}");
    assert_empty(&db.pool).await;
}

#[tokio::test]
async fn database_error_in_flush_names_the_event_type_and_spoils_the_unit_of_work() {
    let db = setup().await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    sqlx::query("INSERT INTO orders (id, customer_id, amount) VALUES ($1, $1, 1)")
        .bind(Uuid::now_v7())
        .execute(uow.tx())
        .await
        .unwrap();
    uow.emit_all(&clashing_payments()).await.unwrap();
    let err = uow.flush().await.unwrap_err();
    assert!(matches!(err, Error::Emit { .. }), "{err}");
    let msg = outbox_runtime::error_chain(&err).to_string();
    assert!(msg.starts_with("cannot emit `PaymentRequested`: "), "{msg}");
    assert!(msg.contains("outbox_event_event_id_key"), "{msg}");
    let refused = uow.commit().await.unwrap_err();
    assert!(
        matches!(refused, Error::EmitFailedEarlier { .. }),
        "{refused}"
    );
    assert_empty(&db.pool).await;
}

#[tokio::test]
async fn event_id_field_is_used_as_the_event_id() {
    let db = setup().await;
    let id = Uuid::new_v4();
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    let returned = uow
        .emit(&PaymentRequested { id, payment_id: 77 })
        .await
        .unwrap();
    uow.commit().await.unwrap();
    assert_eq!(returned, id);
    let (stored, aggregate_id): (Uuid, String) =
        sqlx::query_as("SELECT event_id, aggregate_id FROM outbox_event")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((stored, aggregate_id.as_str()), (id, "77"));
}

#[tokio::test]
async fn concurrent_units_of_work_write_every_event_once() {
    let db = setup().await;
    let pool = db.pool(16).await;
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut ids = Vec::with_capacity(200);
                for _ in 0..200 {
                    let mut uow = Uow::begin(&pool).await.unwrap();
                    ids.push(place_order(&mut uow, &order(3)).await.unwrap());
                    uow.commit().await.unwrap();
                }
                ids
            })
        })
        .collect();
    let mut returned = HashSet::new();
    for task in tasks {
        returned.extend(task.await.unwrap());
    }
    assert_eq!(returned.len(), 3200, "every returned event id is distinct");
    let stored: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM outbox_event")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(stored.len(), 3200);
    assert_eq!(stored.into_iter().collect::<HashSet<_>>(), returned);
    assert_eq!(count(&db.pool, "SELECT count(*) FROM orders").await, 3200);
}

/// A pool of one connection through a proxy that counts what the client sends.
async fn counted_pool(db: &TestDb) -> (Proxy, PgPool) {
    let proxy = Proxy::start("127.0.0.1:5432".into()).await;
    let pool = proxy.pool(&db.url, 1).await;
    (proxy, pool)
}

#[tokio::test]
async fn emit_all_of_1000_events_costs_no_round_trip_and_commit_one() {
    let db = setup().await;
    let (proxy, pool) = counted_pool(&db).await;
    let events: Vec<OrderCreated> = (0..1000).map(|_| order(1)).collect();

    let mut uow = Uow::begin(&pool).await.unwrap();
    let before = proxy.counts.round_trips();
    let ids = uow.emit_all(&events).await.unwrap();
    assert_eq!(proxy.counts.round_trips() - before, 0, "emit does no I/O");
    let (trips, statements) = (proxy.counts.round_trips(), proxy.counts.statements());
    uow.commit().await.unwrap();
    assert_eq!(
        proxy.counts.round_trips() - trips,
        1,
        "rows and COMMIT in one round trip"
    );
    assert_eq!(
        proxy.counts.statements() - statements,
        1,
        "one simple query"
    );

    assert_eq!(ids.len(), 1000);
    let stored: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM outbox_event ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(stored, ids, "ids follow the order of emission");
}

#[tokio::test]
async fn flush_of_1000_events_is_one_statement_and_one_round_trip() {
    let db = setup().await;
    let (proxy, pool) = counted_pool(&db).await;
    let events: Vec<OrderCreated> = (0..1000).map(|_| order(1)).collect();

    let mut uow = Uow::begin(&pool).await.unwrap();
    // The first use of a statement on a connection also prepares it (one more round trip).
    uow.emit(&order(1)).await.unwrap();
    uow.flush().await.unwrap();
    let ids = uow.emit_all(&events).await.unwrap();
    let (trips, statements) = (proxy.counts.round_trips(), proxy.counts.statements());
    uow.flush().await.unwrap();
    assert_eq!(proxy.counts.round_trips() - trips, 1, "one round trip");
    assert_eq!(proxy.counts.statements() - statements, 1, "one statement");
    // Flushed rows are visible inside the transaction, and not outside it before commit.
    assert_eq!(
        count(uow.tx(), "SELECT count(*) FROM outbox_event").await,
        1001
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM outbox_event").await,
        0
    );
    uow.commit().await.unwrap();

    let stored: Vec<Uuid> =
        sqlx::query_scalar("SELECT event_id FROM outbox_event ORDER BY id OFFSET 1")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(stored, ids, "ids follow the order of emission");
}

#[tokio::test]
async fn connection_is_clean_after_the_one_round_trip_commit() {
    let db = setup().await;
    let (_proxy, pool) = counted_pool(&db).await;
    for amount in 1..=3 {
        let mut uow = Uow::begin(&pool).await.unwrap();
        place_order(&mut uow, &order(amount)).await.unwrap();
        uow.commit().await.unwrap();
        // The pool's only connection is idle, not idle in a transaction.
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap();
        let state: String = sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
            .bind(pid)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(
            state, "idle",
            "no transaction is left open on the pooled connection"
        );
    }
    assert_eq!(count(&db.pool, "SELECT count(*) FROM orders").await, 3);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM outbox_event").await,
        3
    );
}

#[tokio::test]
async fn text_survives_the_commit_exactly() {
    #[derive(Serialize, OutboxEvent)]
    #[outbox(topic = "odd.events", aggregate_type = "Odd'\\Type")]
    struct Odd {
        #[outbox(aggregate_id)]
        id: String,
        #[outbox(key)]
        key: String,
        text: String,
    }
    let db = setup().await;
    let nasty = [
        r"it's",
        r"back\slash\\",
        r"\'); DELETE FROM outbox_event; --",
        "E'\\x00' $$ $a$ \" \n\t\r",
        "ключ ✓ 🦀 \u{7f}\u{1}",
    ];
    let events: Vec<Odd> = nasty
        .iter()
        .map(|s| Odd {
            id: format!("id {s}"),
            key: s.to_string(),
            text: s.to_string(),
        })
        .collect();
    // Once through the one-round-trip commit, once through the prepared statement of `flush`.
    for flush in [false, true] {
        sqlx::query("TRUNCATE outbox_event")
            .execute(&db.pool)
            .await
            .unwrap();
        let mut uow = Uow::begin(&db.pool).await.unwrap();
        uow.emit_all(&events).await.unwrap();
        if flush {
            uow.flush().await.unwrap();
        }
        uow.commit().await.unwrap();
        let rows: Vec<(String, String, String, serde_json::Value)> = sqlx::query_as(
            "SELECT aggregate_type, aggregate_id, partition_key, payload FROM outbox_event ORDER BY id",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(rows.len(), nasty.len());
        for (row, s) in rows.iter().zip(nasty) {
            assert_eq!(row.0, "Odd'\\Type");
            assert_eq!(row.1, format!("id {s}"));
            assert_eq!(row.2, s);
            assert_eq!(row.3["text"], s, "flush = {flush}");
        }
    }
}

#[tokio::test]
async fn unit_of_work_on_a_savepoint_commits_only_the_savepoint() {
    let db = setup().await;
    let mut outer = db.pool.begin().await.unwrap();
    {
        let savepoint = sqlx::Connection::begin(&mut *outer).await.unwrap();
        let mut uow = Uow::from_transaction(savepoint);
        place_order(&mut uow, &order(2)).await.unwrap();
        uow.commit().await.unwrap();
    }
    assert_eq!(
        count(&mut *outer, "SELECT count(*) FROM outbox_event").await,
        1,
        "released into the outer transaction"
    );
    outer.rollback().await.unwrap();
    assert_empty(&db.pool).await;
}

#[tokio::test]
async fn emit_all_mixes_event_types_through_records_in_order() {
    let db = setup().await;
    let order_id = Uuid::now_v7();
    let created = OrderCreated {
        order_id,
        customer_id: Uuid::now_v7(),
        amount: 5,
    };
    let line = OrderLineAdded {
        order_id,
        customer: "c-9".into(),
        sku: "SKU-1".into(),
    };
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    let records = vec![
        OutboxRecord::from_event(&created).unwrap(),
        OutboxRecord::from_event(&line).unwrap(),
    ];
    let ids = uow.emit_all(records).await.unwrap();
    assert!(uow
        .emit_all(Vec::<OutboxRecord>::new())
        .await
        .unwrap()
        .is_empty());
    uow.commit().await.unwrap();
    let rows: Vec<(Uuid, String, String)> =
        sqlx::query_as("SELECT event_id, event_type, partition_key FROM outbox_event ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        vec![
            (ids[0], "OrderCreated".into(), order_id.to_string()),
            (ids[1], "OrderLineAdded".into(), "c-9".into()),
        ]
    );
}

#[tokio::test]
async fn emit_on_an_application_managed_transaction() {
    let db = setup().await;
    let event = order(9);

    let mut tx = db.pool.begin().await.unwrap();
    outbox_runtime::emit(&mut tx, &event).await.unwrap();
    tx.rollback().await.unwrap();
    assert_empty(&db.pool).await;

    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (id, customer_id, amount) VALUES ($1, $2, $3)")
        .bind(event.order_id)
        .bind(event.customer_id)
        .bind(event.amount)
        .execute(&mut *tx)
        .await
        .unwrap();
    outbox_runtime::emit(&mut tx, &event).await.unwrap();
    outbox_runtime::emit_all(&mut tx, [&order(1), &order(2)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count(&db.pool, "SELECT count(*) FROM orders").await, 1);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM outbox_event").await,
        3
    );

    // A unit of work can also wrap a transaction the application began.
    let mut uow = Uow::from_transaction(db.pool.begin().await.unwrap());
    uow.emit(&order(4)).await.unwrap();
    uow.commit().await.unwrap();
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM outbox_event").await,
        4
    );
}

#[tokio::test]
async fn emitters_of_one_key_commit_in_id_order() {
    let db = setup().await;
    let key = "customer-42".to_owned();
    let line = |sku: &str| OrderLineAdded {
        order_id: Uuid::now_v7(),
        customer: key.clone(),
        sku: sku.into(),
    };
    // The first unit of work writes its row (taking the key's lock) and stays open.
    let mut first = Uow::begin(&db.pool).await.unwrap();
    first.emit(&line("first")).await.unwrap();
    first.flush().await.unwrap();
    // The second one, on the same key, cannot get its id until the first commits.
    let pool = db.pool.clone();
    let second_line = line("second");
    let second = tokio::spawn(async move {
        let mut uow = Uow::begin(&pool).await.unwrap();
        uow.emit(&second_line).await.unwrap();
        uow.commit().await.unwrap();
    });
    let blocked = async {
        loop {
            let waiting = count(
                &db.pool,
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
            )
            .await;
            if waiting == 1 {
                break;
            }
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), blocked)
        .await
        .expect("the second emitter waits for the first one's key lock");
    assert!(!second.is_finished());
    first.commit().await.unwrap();
    second.await.unwrap();
    let skus: Vec<String> =
        sqlx::query_scalar("SELECT payload->>'sku' FROM outbox_event ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(skus, ["first", "second"]);
}
