//! The unit of work against the transaction code applications really write: repository
//! functions that open their own (nested) transactions, errors caught and ignored, and a
//! connection lost while `COMMIT` is on its way.

use std::time::Duration;

use outbox_runtime::{Error, OutboxEvent, Uow};
use outbox_tests::fixtures::OrderCreated;
use outbox_tests::proxy::Proxy;
use outbox_tests::{count, TestDb};
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
    assert!(matches!(err, Error::Aborted { .. }), "{err}");
    assert!(err.to_string().contains("savepoint"), "{err}");
    assert!(!err.is_transient(), "the same work would abort again");
    assert_eq!(counts(&db.pool).await, (0, 0, 0));
}

#[tokio::test]
async fn a_connection_lost_after_commit_was_sent_is_an_unknown_outcome() {
    let db = setup().await;
    let proxy = Proxy::start("127.0.0.1:5432".into()).await;
    let pool = proxy.pool(&db.url, 1).await;
    let event = order();
    let mut uow = Uow::begin(&pool).await.unwrap();
    insert_order(uow.tx(), &event).await;
    uow.emit(&event).await.unwrap();
    proxy.cut_after_next_commit();
    let err = uow.commit().await.unwrap_err();
    assert!(matches!(err, Error::CommitOutcomeUnknown { .. }), "{err}");
    assert!(err.is_outcome_unknown());
    assert!(!err.is_transient(), "doing it again may do it twice");
    assert!(err.to_string().contains("may have committed"), "{err}");
    // The server got the whole COMMIT and did commit: a caller that retried blindly would
    // write the order twice. (Its connection ends when the server notices the cut.)
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while counts(&db.pool).await != (1, 0, 1) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            counts(&db.pool).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_transaction_is_reachable_as_an_sqlx_transaction() {
    async fn repository(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, event: &OrderCreated) {
        insert_order(tx, event).await;
    }
    let db = setup().await;
    let (first, second) = (order(), order());
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    repository(uow.as_transaction_mut(), &first).await;
    uow.emit(&first).await.unwrap();
    uow.emit(&second).await.unwrap();
    // The application takes the transaction over: the events are written into it first.
    let mut tx = uow.into_inner().await.unwrap();
    assert_eq!(
        count(&mut *tx, "SELECT count(*) FROM outbox_event").await,
        2
    );
    assert_eq!(counts(&db.pool).await, (0, 0, 0), "not committed yet");
    tx.commit().await.unwrap();
    assert_eq!(counts(&db.pool).await, (1, 0, 2));

    // A unit of work begun with a statement of the application's choice.
    let mut uow = Uow::begin_with(&db.pool, "BEGIN ISOLATION LEVEL SERIALIZABLE")
        .await
        .unwrap();
    let level: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(uow.tx())
        .await
        .unwrap();
    assert_eq!(level, "serializable");
    uow.emit(&second).await.unwrap();
    uow.commit().await.unwrap();
    assert_eq!(counts(&db.pool).await, (1, 0, 3));
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(topic = "stock.events", aggregate_type = "Stock")]
struct StockMoved {
    #[outbox(aggregate_id)]
    sku: String,
}

fn moved(sku: &str) -> StockMoved {
    StockMoved { sku: sku.into() }
}

/// Units of work that write their events in several statements (here `flush`) take their
/// keys' locks in steps, and can deadlock; PostgreSQL breaks the deadlock with an error that
/// says to retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_between_flushing_units_of_work_is_a_transient_error() {
    let db = setup().await;
    let mut a = Uow::begin(&db.pool).await.unwrap();
    let mut b = Uow::begin(&db.pool).await.unwrap();
    a.emit(&moved("sku-1")).await.unwrap();
    a.flush().await.unwrap();
    b.emit(&moved("sku-2")).await.unwrap();
    b.flush().await.unwrap();
    let a_task = tokio::spawn(async move {
        a.emit(&moved("sku-2")).await.unwrap();
        let result = a.flush().await;
        (a, result)
    });
    b.emit(&moved("sku-1")).await.unwrap();
    let b_result = b.flush().await;
    let (a, a_result) = a_task.await.unwrap();
    let (failed, winner) = match (a_result, b_result) {
        (Err(e), Ok(())) => (e, b),
        (Ok(()), Err(e)) => (e, a),
        other => panic!("exactly one side must lose the deadlock: {other:?}"),
    };
    assert!(matches!(failed, Error::Emit { .. }), "{failed}");
    assert!(
        outbox_runtime::error_chain(&failed)
            .to_string()
            .contains("deadlock"),
        "{failed:?}"
    );
    assert!(failed.is_transient(), "a deadlock is worth a retry");
    winner.commit().await.unwrap();
    assert_eq!(counts(&db.pool).await.2, 2);
}

/// Units of work that write their events at commit take all their keys' locks at once, in one
/// order: whatever keys they share, in whatever order they emitted them, none deadlocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_of_work_that_emit_at_commit_never_deadlock() {
    let db = setup().await;
    let pool = db.pool(16).await;
    let tasks: Vec<_> = (0..16u64)
        .map(|t| {
            let pool = pool.clone();
            tokio::spawn(async move {
                for i in 0..50u64 {
                    // Ten keys out of twenty, in an order that differs per task and round.
                    let mut skus: Vec<String> = (0..10)
                        .map(|k| format!("sku-{}", (k * 7 + t * 3 + i) % 20))
                        .collect();
                    if (t + i) % 2 == 0 {
                        skus.reverse();
                    }
                    let mut uow = Uow::begin(&pool).await.unwrap();
                    for sku in &skus {
                        uow.emit(&moved(sku)).await.unwrap();
                    }
                    uow.commit().await.unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(counts(&db.pool).await.2, 16 * 50 * 10);
}
