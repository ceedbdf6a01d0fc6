//! The test kit (`outbox-runtime`'s feature `testing`), used as an application would in its own
//! tests: what a command emitted, a handler run as a consumer runs it, a relay publishing to an
//! in-process mock cluster. The `testing` module's docs show the same uses.

use outbox_runtime::inbox::HandlerError;
use outbox_runtime::testing::{self, Delivery, MockKafka};
use outbox_runtime::{OutboxEvent, Uow};
use outbox_tests::{count, TestDb};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Debug, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    order_id: Uuid,
    amount: i64,
}

/// The application's command: an order row and its event, in one transaction.
async fn place_order(pool: &sqlx::PgPool, amount: i64) -> outbox_runtime::Result<Uuid> {
    let order_id = Uuid::now_v7();
    let mut uow = Uow::begin(pool).await?;
    sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, $2)")
        .bind(order_id)
        .bind(amount)
        .execute(uow.tx())
        .await?;
    uow.emit(&OrderPlaced { order_id, amount }).await?;
    uow.commit().await?;
    Ok(order_id)
}

/// The application's handler: a reservation per order; refuses orders of nothing.
#[outbox_runtime::inbox_handler]
async fn reserve_stock(
    event: OrderPlaced,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    if event.amount <= 0 {
        return Err(HandlerError::permanent(format!(
            "order {} is of nothing",
            event.order_id
        )));
    }
    sqlx::query("INSERT INTO reservations (order_id) VALUES ($1)")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    Ok(())
}

async fn schema(db: &TestDb) {
    sqlx::raw_sql(
        "CREATE TABLE orders (id uuid PRIMARY KEY, amount bigint NOT NULL CHECK (amount > 0)); \
         CREATE TABLE reservations (order_id uuid PRIMARY KEY);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_command_emits_its_event_with_its_row() {
    let db = TestDb::new().await;
    schema(&db).await;
    let order_id = place_order(&db.pool, 250).await.unwrap();
    assert_eq!(
        testing::emitted::<OrderPlaced>(&db.pool).await.unwrap(),
        vec![OrderPlaced {
            order_id,
            amount: 250
        }]
    );
    let records = testing::emitted_records(&db.pool).await.unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].partition_key, order_id.to_string());
    assert_eq!(records[0].event_type, "OrderPlaced");
    assert!(!records[0].published);
    assert!(records[0].headers.is_empty());
    assert_eq!(records[0].schema_version, 1);

    // A command that fails after its emit (its second order row is refused) emits nothing.
    let failing = async {
        let mut uow = Uow::begin(&db.pool).await?;
        uow.emit(&OrderPlaced {
            order_id,
            amount: 7,
        })
        .await?;
        uow.flush().await?; // the event row is written, in the transaction
        sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, 7)")
            .bind(order_id)
            .execute(uow.tx())
            .await?; // a duplicate order: the command fails here, the unit of work drops
        uow.commit().await
    };
    failing.await.unwrap_err();
    assert_eq!(testing::emitted_records(&db.pool).await.unwrap().len(), 1);
}

/// A later version of an event, for the records' `schema_version`.
#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order", version = 3)]
struct OrderRepriced {
    #[outbox(aggregate_id)]
    order_id: Uuid,
    amount: i64,
}

#[tokio::test]
async fn emitted_records_show_the_stored_headers_and_the_schema_version() {
    let db = TestDb::new().await;
    let order_id = Uuid::now_v7();
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit_with(
        &OrderRepriced {
            order_id,
            amount: 9,
        },
        [("tenant", "acme"), ("correlation_id", "c-42")],
    )
    .await
    .unwrap();
    uow.commit().await.unwrap();

    let records = testing::emitted_records(&db.pool).await.unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].schema_version, 3);
    assert_eq!(records[0].header("tenant"), Some("acme"));
    assert_eq!(records[0].header("correlation_id"), Some("c-42"));
    assert_eq!(
        records[0].header(outbox_runtime::SCHEMA_VERSION_HEADER),
        Some("3")
    );
    assert_eq!(records[0].headers.len(), 3);
}

#[tokio::test]
async fn a_handler_runs_once_per_event_and_fails_as_a_consumer_would_see_it() {
    let db = TestDb::new().await;
    schema(&db).await;
    let event = OrderPlaced {
        order_id: Uuid::now_v7(),
        amount: 3,
    };
    let id = Uuid::now_v7();
    let deliver = || testing::deliver(&db.pool, "stock", reserve_stock, id, &event);
    assert_eq!(deliver().await.unwrap(), Delivery::Handled);
    assert_eq!(deliver().await.unwrap(), Delivery::Duplicate);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM reservations").await,
        1
    );
    let recorded: String =
        sqlx::query_scalar("SELECT handler FROM processed_event WHERE event_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(recorded, "stock/reserve_stock");

    // A permanent failure: dead-lettered, with the handler's words.
    let nothing = OrderPlaced {
        order_id: Uuid::now_v7(),
        amount: 0,
    };
    match testing::deliver(&db.pool, "stock", reserve_stock, Uuid::now_v7(), &nothing)
        .await
        .unwrap()
    {
        Delivery::Failed { retryable, reason } => {
            assert!(!retryable);
            assert!(reason.contains("is of nothing"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // The same order again under another event id: the reservation's primary key refuses it,
    // an integrity violation, permanent; nothing of that attempt is committed.
    match testing::deliver(&db.pool, "stock", reserve_stock, Uuid::now_v7(), &event)
        .await
        .unwrap()
    {
        Delivery::Failed { retryable, reason } => {
            assert!(!retryable);
            assert!(reason.contains("reservations_pkey"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM processed_event").await,
        1,
        "failed deliveries record nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_to_an_in_process_mock_cluster() {
    let db = TestDb::new().await;
    schema(&db).await;
    let kafka = MockKafka::start().unwrap();
    kafka.create_topic(OrderPlaced::TOPIC, 3).unwrap();
    let mut orders = Vec::new();
    for amount in 1..=5 {
        orders.push(place_order(&db.pool, amount).await.unwrap());
    }
    assert_eq!(kafka.relay_pending(&db.pool).await.unwrap(), 5);
    assert_eq!(kafka.relay_pending(&db.pool).await.unwrap(), 0);
    let records = kafka.records(OrderPlaced::TOPIC).await.unwrap();
    assert_eq!(records.len(), 5);
    let mut keys: Vec<String> = records
        .iter()
        .map(|r| String::from_utf8(r.key.clone().unwrap()).unwrap())
        .collect();
    keys.sort();
    let mut expected: Vec<String> = orders.iter().map(Uuid::to_string).collect();
    expected.sort();
    assert_eq!(keys, expected);
    for r in &records {
        assert_eq!(r.header("event_type"), Some("OrderPlaced"));
        let event: OrderPlaced = serde_json::from_slice(r.payload.as_deref().unwrap()).unwrap();
        assert_eq!(
            Some(event.order_id.to_string().as_str()),
            r.header("aggregate_id")
        );
    }
    // A topic nobody created is an error, not an empty list.
    assert!(kafka.records("no.such.topic").await.is_err());
    assert!(testing::emitted_records(&db.pool)
        .await
        .unwrap()
        .iter()
        .all(|r| r.published));
}

/// [`reserve_stock`] on MariaDB/MySQL.
#[outbox_runtime::inbox_handler]
async fn reserve_stock_mysql(
    event: OrderPlaced,
    tx: &mut sqlx::MySqlConnection,
) -> Result<(), HandlerError> {
    if event.amount <= 0 {
        return Err(HandlerError::permanent(format!(
            "order {} is of nothing",
            event.order_id
        )));
    }
    sqlx::query("INSERT INTO reservations (order_id) VALUES (?)")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kit_reads_emits_delivers_and_relays_on_mariadb() {
    use outbox_tests::mysql::{count, MySqlTestDb};

    let db = MySqlTestDb::new().await;
    sqlx::raw_sql(
        "CREATE TABLE orders (id BINARY(16) PRIMARY KEY, amount BIGINT NOT NULL); \
         CREATE TABLE reservations (order_id BINARY(16) PRIMARY KEY)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // A command on MariaDB: its row and its event, with headers.
    let placed = OrderPlaced {
        order_id: Uuid::now_v7(),
        amount: 3,
    };
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    sqlx::query("INSERT INTO orders (id, amount) VALUES (?, ?)")
        .bind(placed.order_id)
        .bind(placed.amount)
        .execute(uow.tx())
        .await
        .unwrap();
    uow.emit_with(&placed, [("tenant", "acme")]).await.unwrap();
    uow.commit().await.unwrap();
    assert_eq!(
        testing::mysql::emitted::<OrderPlaced>(&db.pool)
            .await
            .unwrap(),
        vec![OrderPlaced { ..placed }]
    );
    let records = testing::mysql::emitted_records(&db.pool).await.unwrap();
    assert_eq!(records.len(), 1);
    let record = &records[0];
    assert_eq!(
        (record.topic.as_str(), record.event_type.as_str()),
        (OrderPlaced::TOPIC, "OrderPlaced")
    );
    assert_eq!(record.partition_key, placed.order_id.to_string());
    assert_eq!(record.header("tenant"), Some("acme"));
    assert_eq!(record.payload["amount"], 3);
    assert!(!record.published);

    // Its handler, as a MariaDB consumer runs it: once per event id.
    let id = record.event_id;
    let deliver = || testing::deliver(&db.pool, "stock", reserve_stock_mysql, id, &placed);
    assert_eq!(deliver().await.unwrap(), Delivery::Handled);
    assert_eq!(deliver().await.unwrap(), Delivery::Duplicate);
    let nothing = OrderPlaced {
        order_id: Uuid::now_v7(),
        amount: 0,
    };
    match testing::deliver(
        &db.pool,
        "stock",
        reserve_stock_mysql,
        Uuid::now_v7(),
        &nothing,
    )
    .await
    .unwrap()
    {
        Delivery::Failed { retryable, reason } => {
            assert!(!retryable);
            assert!(reason.contains("is of nothing"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        count(&db.pool, "SELECT COUNT(*) FROM reservations").await,
        1
    );
    let recorded: String =
        sqlx::query_scalar("SELECT CAST(handler AS CHAR) FROM processed_event WHERE event_id = ?")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(recorded, "stock/reserve_stock_mysql");

    // The real relay, from MariaDB's outbox to the mock cluster.
    let kafka = MockKafka::start().unwrap();
    kafka.create_topic(OrderPlaced::TOPIC, 3).unwrap();
    assert_eq!(kafka.relay_pending(&db.pool).await.unwrap(), 1);
    assert_eq!(kafka.relay_pending(&db.pool).await.unwrap(), 0);
    let published = kafka.records(OrderPlaced::TOPIC).await.unwrap();
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].header("tenant"), Some("acme"));
    assert!(testing::mysql::emitted_records(&db.pool).await.unwrap()[0].published);
}
