//! The unit of work against the transaction code applications really write: repository
//! functions that open their own (nested) transactions, errors caught and ignored, and a
//! connection lost while `COMMIT` is on its way.

use outbox_runtime::Uow;
use outbox_tests::fixtures::OrderCreated;
use outbox_tests::proxy::Proxy;
use outbox_tests::TestDb;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

async fn setup() -> TestDb {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        "CREATE TABLE orders (id uuid PRIMARY KEY, customer_id uuid NOT NULL, amount bigint NOT NULL); \
         CREATE TABLE audit (order_id uuid PRIMARY KEY, note text NOT NULL)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    db
}

fn order() -> OrderCreated {
    OrderCreated {
        order_id: Uuid::now_v7(),
        customer_id: Uuid::now_v7(),
        amount: 10,
    }
}

async fn insert_order(conn: &mut PgConnection, event: &OrderCreated) {
    sqlx::query("INSERT INTO orders (id, customer_id, amount) VALUES ($1, $2, $3)")
        .bind(event.order_id)
        .bind(event.customer_id)
        .bind(event.amount)
        .execute(conn)
        .await
        .unwrap();
}

/// Repository code as sqlx users write it: it takes a connection and wraps its work in a
/// transaction of its own, committed at its end.
async fn audit_in_own_transaction(conn: &mut PgConnection, order_id: Uuid, commit: bool) {
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("INSERT INTO audit (order_id, note) VALUES ($1, 'placed')")
        .bind(order_id)
        .execute(&mut *tx)
        .await
        .unwrap();
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
}

async fn counts(pool: &PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM audit), \
                (SELECT count(*) FROM outbox_event)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_nested_transaction_cannot_commit_the_unit_of_work_early() {
    let db = setup().await;

    // Dropped after the nested transaction committed: nothing may remain.
    let event = order();
    {
        let mut uow = Uow::begin(&db.pool).await.unwrap();
        insert_order(uow.tx(), &event).await;
        audit_in_own_transaction(uow.tx(), event.order_id, true).await;
        uow.emit(&event).await.unwrap();
    }
    // The rollback of a dropped unit of work runs on the pool's side: wait for it.
    db.pool.close().await;
    let pool = db.pool(2).await;
    assert_eq!(
        counts(&pool).await,
        (0, 0, 0),
        "the nested commit released a savepoint, it did not commit the unit of work"
    );

    // Committed: the domain row, the nested work and the event.
    let mut uow = Uow::begin(&pool).await.unwrap();
    insert_order(uow.tx(), &event).await;
    audit_in_own_transaction(uow.tx(), event.order_id, true).await;
    uow.emit(&event).await.unwrap();
    uow.commit().await.unwrap();
    assert_eq!(counts(&pool).await, (1, 1, 1));

    // The nested one rolled back: only the outer work commits, with its event.
    let event = order();
    let mut uow = Uow::begin(&pool).await.unwrap();
    insert_order(uow.tx(), &event).await;
    audit_in_own_transaction(uow.tx(), event.order_id, false).await;
    uow.emit(&event).await.unwrap();
    uow.commit().await.unwrap();
    assert_eq!(counts(&pool).await, (2, 1, 2));
}

#[tokio::test]
async fn commit_of_a_transaction_aborted_by_a_caught_error_is_an_error() {
    let db = setup().await;
    let event = order();
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    insert_order(uow.tx(), &event).await;
    uow.emit(&event).await.unwrap();
    uow.flush().await.unwrap();
    // "Insert; if it already exists, fine": the error is caught, the transaction is aborted.
    let duplicate = sqlx::query("INSERT INTO orders (id, customer_id, amount) VALUES ($1, $1, 1)")
        .bind(event.order_id)
        .execute(uow.tx())
        .await;
    assert!(duplicate.is_err());
    // PostgreSQL answers COMMIT of an aborted transaction with ROLLBACK and no error.
    let err = uow.commit().await.unwrap_err();
    assert!(err.to_string().contains("savepoint"), "{err}");
    assert_eq!(counts(&db.pool).await, (0, 0, 0));
}

#[tokio::test]
async fn a_connection_lost_after_commit_was_sent_is_an_unknown_outcome() {
    let db = setup().await;
    let proxy = Proxy::start("127.0.0.1:5432".into()).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&proxy.url(&db.url))
        .await
        .unwrap();
    let event = order();
    let mut uow = Uow::begin(&pool).await.unwrap();
    insert_order(uow.tx(), &event).await;
    uow.emit(&event).await.unwrap();
    proxy.cut_after_next_commit();
    let err = uow.commit().await.unwrap_err();
    assert!(err.to_string().contains("may have committed"), "{err}");
    // The server got the whole COMMIT and did commit: a caller that retried blindly would
    // write the order twice. (Its connection ends when the server notices the cut.)
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while counts(&db.pool).await != (1, 0, 1) {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", counts(&db.pool).await);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
