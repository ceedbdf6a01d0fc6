//! Errors as an application meets them: printed through `anyhow`, each cause appears once; and
//! `?` on an emit inside a handler retries what may pass next time (a lock or statement
//! timeout, a deadlock) instead of dead-lettering the message.

use std::error::Error as _;

use outbox_runtime::inbox::HandlerError;
use outbox_runtime::{Error, Uow};
use outbox_tests::fixtures::posted;
use outbox_tests::TestDb;

/// Holds the advisory lock `outbox_emit` takes for `key` in a transaction of its own, so that an
/// emit of that key waits.
async fn hold_key_lock(
    pool: &sqlx::PgPool,
    key: &str,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(1868724325, hashtext($1))")
        .bind(key)
        .execute(&mut *holder)
        .await
        .unwrap();
    holder
}

/// An emit, in a transaction with `setting`, of a key another transaction holds: it times out.
async fn timed_out_emit(pool: &sqlx::PgPool, setting: &str) -> Error {
    let _holder = hold_key_lock(pool, "L-1").await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(setting).execute(&mut *tx).await.unwrap();
    outbox_runtime::emit(&mut tx, &posted("L-1"))
        .await
        .expect_err("the key is locked elsewhere")
}

#[tokio::test]
async fn a_timeout_during_emit_in_a_handler_is_retryable() {
    let db = TestDb::new().await;
    for setting in [
        "SET LOCAL lock_timeout = '50ms'",
        "SET LOCAL statement_timeout = '50ms'",
    ] {
        let error = timed_out_emit(&db.pool, setting).await;
        assert!(error.is_transient(), "{setting}: {error:?}");
        let handler_error = HandlerError::from(error);
        assert!(
            handler_error.is_retryable(),
            "{setting}: a timeout must be retried, not dead-lettered: {handler_error:?}"
        );
    }

    // What will never pass is still permanent: a payload the emit refuses, a duplicate event id.
    let mut tx = db.pool.begin().await.unwrap();
    let invalid = outbox_runtime::emit(&mut tx, &posted(""))
        .await
        .unwrap_err();
    assert!(!invalid.is_transient(), "{invalid:?}");
    assert!(!HandlerError::from(invalid).is_retryable());
    drop(tx);
    let twice = posted("L-2");
    let mut tx = db.pool.begin().await.unwrap();
    outbox_runtime::emit(&mut tx, &twice).await.unwrap();
    let duplicate = outbox_runtime::emit(&mut tx, &twice).await.unwrap_err();
    assert!(!duplicate.is_transient(), "{duplicate:?}");
    assert!(!HandlerError::from(duplicate).is_retryable());
}

/// The lines of `anyhow`'s `{:?}`: the error, then each cause ("Caused by:" and "N: " dropped,
/// and the backtrace when `RUST_BACKTRACE` asks for one).
fn report_lines(error: anyhow::Error) -> Vec<String> {
    format!("{error:?}")
        .lines()
        .map(str::trim)
        .take_while(|l| *l != "Stack backtrace:")
        .filter(|l| !l.is_empty() && *l != "Caused by:")
        .map(|l| {
            l.split_once(": ")
                .filter(|(n, _)| n.parse::<u32>().is_ok())
                .map_or(l, |(_, rest)| rest)
                .to_owned()
        })
        .collect()
}

/// `error` through anyhow has `lines` lines, and none of the first `ours` (this crate's errors
/// and the application's context) repeats a line after it. The lines after those are sqlx's
/// own, which do repeat themselves ("error returned from database: X", then "X").
#[track_caller]
fn assert_no_repeats(error: anyhow::Error, ours: usize, lines: usize) {
    let report = report_lines(error);
    assert_eq!(report.len(), lines, "{report:#?}");
    for (i, line) in report.iter().enumerate().take(ours) {
        for cause in &report[i + 1..] {
            assert!(
                !line.contains(cause.as_str()),
                "`{line}` repeats its cause `{cause}`:\n{report:#?}"
            );
        }
    }
}

#[tokio::test]
async fn errors_printed_through_anyhow_name_each_cause_once() {
    let db = TestDb::new().await;

    // An emit the database refuses (the duplicate event id of a batch).
    let twice = posted("L-3");
    let mut tx = db.pool.begin().await.unwrap();
    outbox_runtime::emit(&mut tx, &twice).await.unwrap();
    let emit = outbox_runtime::emit(&mut tx, &twice).await.unwrap_err();
    assert!(matches!(emit, Error::Emit { .. }), "{emit:?}");
    assert!(emit.source().is_some());
    drop(tx);
    assert_no_repeats(emit.into(), 1, 3);

    // A commit the database refuses: a deferred constraint checked at commit.
    sqlx::query(
        "CREATE TABLE account (id int PRIMARY KEY, \
             owner int REFERENCES account (id) DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    sqlx::query("INSERT INTO account VALUES (1, 2)")
        .execute(uow.tx())
        .await
        .unwrap();
    uow.emit(&posted("L-4")).await.unwrap();
    let commit = uow.commit().await.unwrap_err();
    assert!(matches!(commit, Error::Commit { .. }), "{commit:?}");
    assert_no_repeats(commit.into(), 1, 3);

    // The same, returned by a handler through `?`, wrapped by the application's own error.
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    sqlx::query("INSERT INTO account VALUES (3, 4)")
        .execute(uow.tx())
        .await
        .unwrap();
    let handler = HandlerError::from(uow.commit().await.unwrap_err());
    assert_no_repeats(
        anyhow::Error::new(handler).context("charging order 7"),
        2,
        4,
    );

    // A Kafka client the relay cannot create (a setting librdkafka refuses).
    let mut config = rdkafka::ClientConfig::new();
    config.set("no.such.setting", "1");
    let relay = outbox_runtime::relay::Relay::builder(db.pool.clone())
        .brokers("127.0.0.1:9")
        .producer_config(config)
        .build();
    let kafka = match relay {
        Err(e) => e,
        Ok(_) => panic!("librdkafka accepts `no.such.setting`"),
    };
    assert!(
        kafka.source().is_some(),
        "the librdkafka error is a typed source: {kafka:?}"
    );
    assert_no_repeats(kafka.into(), 1, 2);
}
