//! The unit of work and the emit functions on MariaDB (issue 38): atomic with the domain rows,
//! never committed after the server rolled the transaction back, per key in commit order, and
//! nothing half-written.

use std::time::Duration;

use outbox_runtime::{Error, OutboxEvent, Uow};
use outbox_tests::mysql::{count, MySqlTestDb};
use serde::Serialize;
use sqlx::{Acquire, MySqlConnection, MySqlPool};
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, OutboxEvent)]
#[outbox(
    topic = "order.events",
    aggregate_type = "Order",
    event_type = "OrderPlaced"
)]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    order: String,
    #[outbox(event_id)]
    id: Uuid,
    note: String,
}

/// The rows' keys (text columns with a `_bin` collation read as bytes in sqlx: cast them).
const KEYS_IN_ID_ORDER: &str = "SELECT CAST(partition_key AS CHAR) FROM outbox_event ORDER BY id";

fn placed(order: &str) -> OrderPlaced {
    OrderPlaced {
        order: order.to_owned(),
        id: Uuid::now_v7(),
        note: "it's \\ \"quoted\" ✓".to_owned(),
    }
}

async fn setup() -> MySqlTestDb {
    let db = MySqlTestDb::new().await;
    sqlx::query("CREATE TABLE orders (id VARCHAR(64) PRIMARY KEY) ENGINE = InnoDB")
        .execute(&db.pool)
        .await
        .unwrap();
    db
}

async fn insert_order(conn: &mut MySqlConnection, id: &str) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO orders (id) VALUES (?)")
        .bind(id)
        .execute(conn)
        .await
        .map(drop)
}

/// An outbox row as the test reads it: id, event id, aggregate id, topic, payload, headers,
/// event type, key bucket, and SQL's `CRC32(partition_key) & 65535`.
type Row = (
    i64,
    Vec<u8>,
    String,
    String,
    Vec<u8>,
    Option<Vec<u8>>,
    String,
    u16,
    u16,
);

async fn outbox_rows(pool: &MySqlPool) -> i64 {
    count(pool, "SELECT COUNT(*) FROM outbox_event").await
}

#[tokio::test]
async fn migrations_apply_again_and_at_once_and_create_every_key_bucket() {
    let db = MySqlTestDb::empty().await;
    let runs = (0..4).map(|_| outbox_runtime::mysql::migrate(&db.pool));
    for result in futures_util::future::join_all(runs).await {
        result.expect("concurrent migrations");
    }
    outbox_runtime::mysql::migrate(&db.pool)
        .await
        .expect("again");
    assert_eq!(
        count(&db.pool, "SELECT COUNT(*) FROM outbox_key_lock").await,
        65_536
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT CAST(MAX(bucket) AS SIGNED) FROM outbox_key_lock"
        )
        .await,
        65_535
    );
    assert_eq!(
        count(&db.pool, "SELECT COUNT(*) FROM outbox_schema_migrations").await,
        outbox_runtime::mysql::MIGRATIONS.len() as i64
    );
}

#[tokio::test]
async fn a_committed_unit_of_work_writes_its_domain_and_outbox_rows_together() {
    let db = setup().await;
    let first = placed("order-1");
    let second = placed("заказ-2");
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    insert_order(uow.tx(), "order-1").await.unwrap();
    uow.emit(&first).await.unwrap();
    uow.emit_with(&second, [("tenant", "acme")]).await.unwrap();
    uow.flush().await.unwrap();
    assert_eq!(
        outbox_rows(&db.pool).await,
        0,
        "nothing visible before commit"
    );
    uow.commit().await.unwrap();

    assert_eq!(count(&db.pool, "SELECT COUNT(*) FROM orders").await, 1);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT id, event_id, CAST(aggregate_id AS CHAR), CAST(topic AS CHAR), \
             CAST(payload AS BINARY), CAST(headers AS BINARY), CAST(event_type AS CHAR), \
             key_bucket, CRC32(partition_key) & 65535 FROM outbox_event ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2);
    assert!(rows[0].0 < rows[1].0, "ids in emission order");
    for (row, event) in rows.iter().zip([&first, &second]) {
        assert_eq!(row.1, event.id.as_bytes().to_vec());
        assert_eq!(row.2, event.order);
        assert_eq!(row.3, "order.events");
        let payload: serde_json::Value = serde_json::from_slice(&row.4).unwrap();
        assert_eq!(
            payload["note"], event.note,
            "text exact through the literal"
        );
        assert_eq!(row.6, "OrderPlaced");
        assert_eq!(row.7, row.8, "the bucket is SQL's CRC32(key) & 65535");
    }
    assert_eq!(rows[0].5, None);
    let headers: serde_json::Value = serde_json::from_slice(rows[1].5.as_ref().unwrap()).unwrap();
    assert_eq!(headers["tenant"], "acme");
}

#[tokio::test]
async fn a_rolled_back_or_dropped_unit_of_work_leaves_nothing() {
    let db = setup().await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    insert_order(uow.tx(), "a").await.unwrap();
    uow.emit(&placed("a")).await.unwrap();
    uow.flush().await.unwrap();
    uow.rollback().await.unwrap();

    let mut uow = Uow::begin(&db.pool).await.unwrap();
    insert_order(uow.tx(), "b").await.unwrap();
    uow.emit(&placed("b")).await.unwrap();
    uow.flush().await.unwrap();
    drop(uow);

    assert_eq!(count(&db.pool, "SELECT COUNT(*) FROM orders").await, 0);
    assert_eq!(outbox_rows(&db.pool).await, 0);
}

/// Makes InnoDB roll `victim`'s transaction back as a deadlock's victim: another transaction
/// that has written more (InnoDB rolls back the one that has written less, whichever closes
/// the cycle) and `victim` each lock a row the other then asks for. Returns the victim's error.
async fn deadlock(db: &MySqlTestDb, victim: &mut MySqlConnection) -> sqlx::Error {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS pair (id INT PRIMARY KEY) ENGINE = InnoDB; \
         CREATE TABLE IF NOT EXISTS filler (id INT PRIMARY KEY) ENGINE = InnoDB; \
         INSERT IGNORE INTO pair VALUES (1), (2)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut other = db.connection().await;
    let fill = format!(
        "BEGIN; INSERT INTO filler VALUES {}; SELECT id FROM pair WHERE id = 1 FOR UPDATE",
        (1..=500)
            .map(|i| format!("({i})"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    sqlx::raw_sql(&fill).execute(&mut other).await.unwrap();
    sqlx::query("SELECT id FROM pair WHERE id = 2 FOR UPDATE")
        .execute(&mut *victim)
        .await
        .unwrap();
    let other_asks = tokio::spawn(async move {
        let result = sqlx::query("SELECT id FROM pair WHERE id = 2 FOR UPDATE")
            .execute(&mut other)
            .await;
        (other, result)
    });
    let error = sqlx::query("SELECT id FROM pair WHERE id = 1 FOR UPDATE")
        .execute(&mut *victim)
        .await
        .expect_err("a deadlock");
    let (mut other, result) = other_asks.await.unwrap();
    result.expect("the other transaction goes on");
    sqlx::raw_sql("ROLLBACK").execute(&mut other).await.unwrap();
    error
}

fn is_deadlock(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("40001"))
}

#[tokio::test]
async fn a_unit_of_work_the_server_rolled_back_is_never_reported_committed() {
    let db = setup().await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    insert_order(uow.tx(), "before").await.unwrap();
    let error = deadlock(&db, uow.tx()).await;
    assert!(is_deadlock(&error), "{error}");
    // The application catches the error and goes on: on InnoDB its statements now run outside
    // any transaction, each committed at once.
    insert_order(uow.tx(), "after").await.unwrap();
    uow.emit(&placed("after")).await.unwrap();
    let error = uow.commit().await.expect_err("not committed");
    assert!(matches!(error, Error::NotInTransaction { .. }), "{error:?}");
    assert!(error.to_string().contains("OrderPlaced"), "{error}");
    assert_eq!(
        outbox_rows(&db.pool).await,
        0,
        "no outbox row committed alone"
    );
    let orders: Vec<String> = sqlx::query_scalar("SELECT id FROM orders")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        orders,
        ["after"],
        "the deadlock undid `before`; `after` ran alone"
    );
}

#[tokio::test]
async fn a_flush_or_an_emit_after_the_server_rolled_back_writes_nothing() {
    let db = setup().await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    deadlock(&db, uow.tx()).await;
    uow.emit(&placed("x")).await.unwrap();
    let error = uow.flush().await.expect_err("refused");
    assert!(matches!(error, Error::NotInTransaction { .. }), "{error:?}");
    assert!(matches!(
        uow.commit().await,
        Err(Error::EmitFailedEarlier { .. })
    ));

    let mut tx = db.pool.begin().await.unwrap();
    deadlock(&db, &mut tx).await;
    let error = outbox_runtime::mysql::emit(&mut tx, &placed("y"))
        .await
        .expect_err("refused");
    assert!(matches!(error, Error::NotInTransaction { .. }), "{error:?}");
    tx.commit().await.unwrap();
    assert_eq!(outbox_rows(&db.pool).await, 0);
}

#[tokio::test]
async fn an_emit_outside_a_transaction_is_refused() {
    let db = setup().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let error = outbox_runtime::mysql::emit_all(&mut conn, [&placed("a"), &placed("b")])
        .await
        .expect_err("refused");
    assert!(matches!(error, Error::NotInTransaction { .. }), "{error:?}");
    assert_eq!(outbox_rows(&db.pool).await, 0);

    let mut tx = conn.begin().await.unwrap();
    let ids = outbox_runtime::mysql::emit_all(&mut tx, [&placed("a"), &placed("b")])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(ids.len(), 2);
    assert_eq!(outbox_rows(&db.pool).await, 2);
}

/// Per key, `id` order is commit order: a key's second writer waits for the first to commit
/// before it takes its id (a row of another key committed meanwhile gets an id below it); a
/// writer of another key does not wait.
#[tokio::test]
async fn a_keys_next_writer_takes_its_id_after_the_one_before_commits() {
    let db = setup().await;
    let mut first = Uow::begin(&db.pool).await.unwrap();
    first.emit(&placed("k")).await.unwrap();
    first.flush().await.unwrap();

    let pool = db.pool.clone();
    let second = tokio::spawn(async move {
        let mut second = Uow::begin(&pool).await.unwrap();
        second.emit(&placed("k")).await.unwrap();
        second.commit().await.unwrap();
    });
    // The second writer's round trip stands at its key lock (its INSERT comes after it).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while count(
        &db.pool,
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
         WHERE DB = DATABASE() AND INFO LIKE 'SELECT bucket FROM outbox_key_lock%'",
    )
    .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the second writer should wait at its key lock"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let mut other_key = Uow::begin(&db.pool).await.unwrap();
    other_key.emit(&placed("j")).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), other_key.commit())
        .await
        .expect("another key's writer does not wait")
        .unwrap();
    assert!(
        !second.is_finished(),
        "the second writer waits for the first"
    );
    first.commit().await.unwrap();
    second.await.unwrap();

    let keys: Vec<String> = sqlx::query_scalar(KEYS_IN_ID_ORDER)
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(keys, ["k", "j", "k"], "the second k took its id after j's");
}

#[tokio::test]
async fn a_savepoint_commits_into_its_transaction_and_its_rollback_undoes_only_its_own() {
    let db = setup().await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit(&placed("outer")).await.unwrap();
    {
        let mut inner = Uow::from_transaction(uow.as_transaction_mut().begin().await.unwrap());
        inner.emit(&placed("kept")).await.unwrap();
        inner.commit().await.unwrap();
    }
    {
        let mut inner = Uow::from_transaction(uow.as_transaction_mut().begin().await.unwrap());
        inner.emit(&placed("undone")).await.unwrap();
        inner.flush().await.unwrap();
        inner.rollback().await.unwrap();
    }
    uow.commit().await.unwrap();
    let keys: Vec<String> = sqlx::query_scalar(KEYS_IN_ID_ORDER)
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(keys, ["kept", "outer"]);
}

#[tokio::test]
async fn an_event_the_columns_cannot_hold_is_refused_and_nothing_is_written() {
    let db = setup().await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    insert_order(uow.tx(), "long").await.unwrap();
    uow.emit(&placed("fits")).await.unwrap();
    let error = uow
        .emit(&placed(&"x".repeat(70_000)))
        .await
        .expect_err("an aggregate id longer than TEXT");
    assert!(
        error.to_string().contains("aggregate id is longer than"),
        "{error}"
    );
    assert!(matches!(
        uow.commit().await,
        Err(Error::EmitFailedEarlier { .. })
    ));
    assert_eq!(count(&db.pool, "SELECT COUNT(*) FROM orders").await, 0);
    assert_eq!(outbox_rows(&db.pool).await, 0);
}

/// A write of several round trips that fails in a later one leaves none of its rows in the
/// application's transaction, which goes on and commits.
#[tokio::test]
async fn a_write_that_fails_part_way_leaves_none_of_its_rows() {
    let db = setup().await;
    let big = |id: Uuid| OrderPlaced {
        order: "big".to_owned(),
        id,
        note: "n".repeat(3 << 20),
    };
    let mut tx = db.pool.begin().await.unwrap();
    insert_order(&mut tx, "kept").await.unwrap();
    let repeated = Uuid::now_v7();
    // Each payload is a round trip of its own; the second repeats the first's event id.
    let error = outbox_runtime::mysql::emit_all(&mut tx, [&big(repeated), &big(repeated)])
        .await
        .expect_err("a duplicate event id");
    assert!(matches!(error, Error::Emit { .. }), "{error:?}");
    tx.commit().await.unwrap();
    assert_eq!(count(&db.pool, "SELECT COUNT(*) FROM orders").await, 1);
    assert_eq!(outbox_rows(&db.pool).await, 0);
}

#[tokio::test]
async fn a_large_unit_of_work_commits_in_several_round_trips_in_order() {
    let db = setup().await;
    // 3 MB of payload: under the automatic flush (8 MiB), over a round trip (4 MiB, hex
    // doubling it): the commit itself takes two.
    let events: Vec<OrderPlaced> = (0..3_000)
        .map(|i| OrderPlaced {
            order: format!("order-{}", i % 50),
            id: Uuid::now_v7(),
            note: "p".repeat(1_000),
        })
        .collect();
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit_all(&events).await.unwrap();
    uow.commit().await.unwrap();
    let ids: Vec<Vec<u8>> = sqlx::query_scalar("SELECT event_id FROM outbox_event ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let expected: Vec<Vec<u8>> = events.iter().map(|e| e.id.as_bytes().to_vec()).collect();
    assert_eq!(ids, expected);
}

/// DDL commits on its own on MariaDB: a migration cut short after its first statement leaves
/// that statement's table. Running `migrate` again completes it, and an applied migration
/// edited afterwards is refused.
#[tokio::test]
async fn a_migration_cut_short_completes_when_run_again_and_an_edited_one_is_refused() {
    let db = MySqlTestDb::empty().await;
    let first = outbox_runtime::mysql::MIGRATIONS[0];
    let (create_outbox, _) = first.sql.split_once(";\n").unwrap();
    sqlx::raw_sql(create_outbox)
        .execute(&db.pool)
        .await
        .unwrap();
    outbox_runtime::mysql::migrate(&db.pool)
        .await
        .expect("completes");
    assert_eq!(
        count(&db.pool, "SELECT COUNT(*) FROM outbox_key_lock").await,
        65_536
    );
    let mut tx = db.pool.begin().await.unwrap();
    outbox_runtime::mysql::emit(&mut tx, &placed("a"))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    sqlx::query("UPDATE outbox_schema_migrations SET checksum = checksum + 1")
        .execute(&db.pool)
        .await
        .unwrap();
    let error = outbox_runtime::mysql::migrate(&db.pool)
        .await
        .expect_err("an edited migration");
    assert!(matches!(error, Error::MigrationChanged { .. }), "{error:?}");
}

/// With `autocommit=0` a statement after the server rolled a transaction back begins the next
/// one silently, so the probe could not tell: such a session is refused, with what to change.
#[tokio::test]
async fn a_session_with_autocommit_off_is_refused_with_what_to_change() {
    let db = setup().await;
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SET autocommit = 0")
        .execute(&mut *tx)
        .await
        .unwrap();
    let error = outbox_runtime::mysql::emit(&mut tx, &placed("a"))
        .await
        .expect_err("refused");
    assert!(error.to_string().contains("autocommit=1"), "{error}");
    sqlx::query("SET autocommit = 1")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(outbox_rows(&db.pool).await, 0);
}

/// A row bigger than a round trip can carry is refused when it is emitted, not by the server
/// dropping the connection (and retried for ever).
#[tokio::test]
async fn an_event_over_the_row_limit_is_refused_at_emit() {
    let db = setup().await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    let huge = OrderPlaced {
        order: "huge".to_owned(),
        id: Uuid::now_v7(),
        note: "h".repeat(8 << 20),
    };
    let error = uow.emit(&huge).await.expect_err("refused");
    assert!(matches!(error, Error::InvalidEvent { .. }), "{error:?}");
    assert!(error.to_string().contains("at most"), "{error}");
    drop(uow);
    // The emit functions check it too, before they write.
    let mut tx = db.pool.begin().await.unwrap();
    let error = outbox_runtime::mysql::emit(&mut tx, &huge)
        .await
        .expect_err("refused");
    assert!(matches!(error, Error::InvalidEvent { .. }), "{error:?}");
    tx.commit().await.unwrap();
    assert_eq!(outbox_rows(&db.pool).await, 0);
}
