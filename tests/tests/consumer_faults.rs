//! Consumers on PostgreSQL against the handlers and inputs real services have: a handler that
//! catches a database error (its transaction left aborted), a panicking inbox handler, payloads
//! `jsonb` refuses, work refused only at commit. What both databases share (panics in dedup
//! mode, two services with handlers of the same name, a message that keeps failing) is
//! `consumer_contract.rs`.

use std::time::Duration;

use outbox_runtime::inbox::Mode;
use outbox_tests::fixtures::{self, PAYMENTS};
use outbox_tests::kafka::{produce, Kafka, Outgoing};
use outbox_tests::payments::{
    builder, dead_letters, orders_with_payments, orders_with_special_payments, paid_counts,
    publish, read_at, retried, setup, wait_for,
};
use outbox_tests::{count, Running};
use sqlx::PgPool;
use uuid::Uuid;

/// The reasons of `n` dead letters: read off the dead-letter topic (dedup mode) or from the
/// dead inbox rows (inbox mode), once there are `n`.
async fn dead_reasons(pool: &PgPool, kafka: &Kafka, mode: Mode, n: usize) -> Vec<String> {
    match mode {
        Mode::Dedup => dead_letters(kafka, n, Duration::from_secs(30))
            .await
            .iter()
            .map(|r| r.header("dlq_error").to_owned())
            .collect(),
        Mode::Inbox => {
            wait_for(
                &format!("{n} dead rows"),
                Duration::from_secs(30),
                || async {
                    count(
                        pool,
                        "SELECT count(*) FROM inbox_event WHERE dead_at IS NOT NULL",
                    )
                    .await
                        == n as i64
                },
            )
            .await;
            sqlx::query_scalar("SELECT last_error FROM inbox_event WHERE dead_at IS NOT NULL")
                .fetch_all(pool)
                .await
                .unwrap()
        }
    }
}

/// 200 payments, every 50th already in the ledger: a handler that swallows the unique
/// violation leaves its transaction aborted. The other 196 must be recorded; the 4 are failures
/// (retried, then dead-lettered) whose error says the transaction was left aborted.
async fn swallowed_errors(mode: Mode) {
    let (db, kafka) = setup().await;
    fixtures::create_ledger(&db.pool).await;
    let payments = orders_with_payments(&db.pool, 200).await;
    for (_, p) in payments.iter().step_by(50) {
        sqlx::query("INSERT INTO ledger (order_id, amount) VALUES ($1, 1)")
            .bind(p.order_id)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    publish(&kafka, &payments).await;
    let consumer = builder(&db, &kafka, "ledger")
        .handler(fixtures::record_payment_swallowing_duplicates)
        .mode(mode)
        .max_attempts(2)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for(
        "196 new payments recorded",
        Duration::from_secs(60),
        || async { count(&db.pool, "SELECT count(*) FROM ledger WHERE amount = 100").await == 196 },
    )
    .await;
    let reasons = dead_reasons(&db.pool, &kafka, mode, 4).await;
    running.stop().await;
    if matches!(mode, Mode::Dedup) {
        // Dead-lettered from the retry topic: the headers say where the original was read.
        let originals = read_at(&kafka, payments.len()).await;
        for dead in dead_letters(&kafka, 4, Duration::from_secs(30)).await {
            assert_eq!(dead.header("dlq_attempts"), "2");
            let (partition, offset) = &originals[dead.header("event_id")];
            assert_eq!(dead.header("dlq_source_topic"), PAYMENTS);
            assert_eq!(dead.header("dlq_source_partition"), partition);
            assert_eq!(dead.header("dlq_source_offset"), offset);
        }
    }
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    for reason in &reasons {
        assert!(reason.contains("left its transaction aborted"), "{reason}");
        assert!(reason.contains("savepoint"), "{reason}");
    }
    assert_eq!(count(&db.pool, "SELECT count(*) FROM ledger").await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_a_handler_that_swallows_a_database_error_fails_only_its_message() {
    swallowed_errors(Mode::Dedup).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_a_handler_that_swallows_a_database_error_fails_only_its_row() {
    swallowed_errors(Mode::Inbox).await;
}

/// Payloads that are JSON to serde but that `jsonb` refuses: a lone surrogate escape, a number
/// beyond `numeric`. In inbox mode they are dead-lettered with PostgreSQL's reason, and the
/// partition flows on; an escaped backslash followed by `u0000` is no NUL and is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_payloads_jsonb_refuses_are_dead_lettered_and_the_partition_flows() {
    let (db, kafka) = setup().await;
    let payments = orders_with_payments(&db.pool, 3).await;
    let key = "one-partition".to_owned();
    let record = |i: usize, extra: &str| {
        let p = &payments[i].1;
        let mut r = Outgoing::event(p, Uuid::now_v7());
        r.key = key.clone();
        r.payload = format!(
            r#"{{"payment_id":"{}","order_id":"{}","amount":100{extra}}}"#,
            p.payment_id, p.order_id
        )
        .into_bytes();
        r
    };
    let records = vec![
        record(0, ""),
        record(1, r#","note":"\udc00""#),
        record(1, r#","n":1e1000000"#),
        record(1, r#","note":"a\\u0000b""#),
        record(2, ""),
    ];
    produce(&kafka.bootstrap(), PAYMENTS, &records).await;
    let consumer = builder(&db, &kafka, "orders")
        .handler(fixtures::mark_order_paid)
        .mode(Mode::Inbox)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for(
        "three payments applied",
        Duration::from_secs(30),
        || async { paid_counts(&db.pool).await.iter().sum::<i32>() == 3 },
    )
    .await;
    let dead = dead_letters(&kafka, 2, Duration::from_secs(30)).await;
    running.stop().await;
    assert_eq!(dead.len(), 2);
    assert_eq!(dead[0].raw, records[1].payload);
    assert_eq!(dead[1].raw, records[2].payload);
    for r in &dead {
        assert!(
            r.header("dlq_error")
                .contains("PostgreSQL refuses the payload as jsonb"),
            "{}",
            r.header("dlq_error")
        );
    }
    assert_eq!(paid_counts(&db.pool).await.iter().sum::<i32>(), 3);
    let stored: String =
        sqlx::query_scalar("SELECT payload->>'note' FROM inbox_event WHERE payload ? 'note'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(stored, "a\\u0000b");
}

/// A panicking handler is a failure like any other: retried (here it then succeeds), its
/// effect once; the consumer and the processors keep running.
async fn panics(mode: Mode) {
    let (db, kafka) = setup().await;
    let payments = orders_with_special_payments(&db.pool, 10, |i| i % 5 == 0, 13).await;
    publish(&kafka, &payments).await;
    let consumer = builder(&db, &kafka, "orders")
        .handler(fixtures::panicky_mark_paid)
        .mode(mode)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for("every payment applied", Duration::from_secs(30), || async {
        paid_counts(&db.pool).await.iter().sum::<i32>() == 10
    })
    .await;
    // More messages after the panics: the consumer is still there.
    let more = orders_with_payments(&db.pool, 5).await;
    publish(&kafka, &more).await;
    wait_for(
        "the later payments applied",
        Duration::from_secs(30),
        || async { paid_counts(&db.pool).await.iter().sum::<i32>() == 15 },
    )
    .await;
    assert!(!running.is_finished(), "the consumer is still running");
    running.stop().await;
    assert!(paid_counts(&db.pool).await.iter().all(|&n| n == 1));
    // A handler may run again when a batch-mate fails (its work rolled back with the
    // batch); the panicking ones ran at least twice, with one effect.
    for (_, p) in payments.iter().filter(|(_, p)| p.amount == 13) {
        assert!(fixtures::PANICKY_CALLS.lock().unwrap()[&p.order_id] >= 2);
    }
    // Each panic was one failed attempt, with the panic's message.
    let errors: Vec<String> = match mode {
        Mode::Dedup => retried(&kafka, 2)
            .await
            .iter()
            .map(|r| r.header("outbox_retry_error").to_owned())
            .collect(),
        _ => sqlx::query_scalar("SELECT last_error FROM inbox_event WHERE attempts > 0")
            .fetch_all(&db.pool)
            .await
            .unwrap(),
    };
    assert_eq!(errors.len(), 2, "{errors:?}");
    for e in errors {
        assert!(
            e.contains("panicked: the payment provider's client panicked"),
            "{e}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_a_panicking_handler_is_a_failure_not_a_dead_processor() {
    panics(Mode::Inbox).await;
}

/// A handler whose work PostgreSQL refuses only at commit (a deferred constraint): the message
/// is a failure of its own (an integrity violation: dead-lettered at once), not a database
/// outage retried forever; the rest of its batch commits.
async fn refused_at_commit(mode: Mode) {
    let (db, kafka) = setup().await;
    fixtures::create_receipts(&db.pool).await;
    let payments = orders_with_special_payments(&db.pool, 20, |i| i % 10 == 3, 9).await;
    publish(&kafka, &payments).await;
    let consumer = builder(&db, &kafka, "receipts")
        .handler(fixtures::write_receipt)
        .mode(mode)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for("18 receipts", Duration::from_secs(30), || async {
        count(&db.pool, "SELECT count(*) FROM receipt").await == 18
    })
    .await;
    let reasons = dead_reasons(&db.pool, &kafka, mode, 2).await;
    running.stop().await;
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    for reason in &reasons {
        assert!(reason.contains("refused at commit"), "{reason}");
        assert!(reason.contains("one_receipt_per_order"), "{reason}");
    }
    let nines: Vec<Uuid> = payments
        .iter()
        .filter(|(_, p)| p.amount == 9)
        .map(|(_, p)| p.order_id)
        .collect();
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM receipt WHERE order_id = ANY($1)")
        .bind(&nines)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(written, 0, "the refused messages left nothing");
    if mode == Mode::Dedup {
        let marked = count(
            &db.pool,
            "SELECT count(*) FROM processed_event WHERE handler LIKE 'receipts/%'",
        )
        .await;
        assert_eq!(marked, 18, "no dedup row for a refused message");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_work_refused_at_commit_fails_its_message_not_the_consumer() {
    refused_at_commit(Mode::Dedup).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_work_refused_at_commit_fails_its_row_not_the_processor() {
    refused_at_commit(Mode::Inbox).await;
}
