//! What the test modules share: running the binary and reading its output, counting rows,
//! the ledger events and hand-made outbox rows, and waiting on and signalling a child.

use std::io::BufRead;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use outbox_runtime::{OutboxEvent, Uow};
use outbox_tests::ChildGuard;
use serde::Serialize;
use sqlx::PgPool;

pub use outbox_tests::count;

pub const TOPIC: &str = "ledger.events";

#[derive(Serialize, OutboxEvent)]
#[outbox(
    topic = "ledger.events",
    aggregate_type = "Ledger",
    event_type = "Posted"
)]
pub struct Posted {
    #[outbox(aggregate_id)]
    ledger: String,
    seq: u32,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(
    topic = "ledger.events",
    aggregate_type = "Ledger",
    event_type = "Closed"
)]
pub struct Closed {
    #[outbox(aggregate_id)]
    pub ledger: String,
}

/// The binary, with no inherited configuration and nothing on stdin.
pub fn outbox(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("KAFKA_BROKERS")
        .stdin(Stdio::null());
    cmd
}

/// Runs the binary with `DATABASE_URL` = `url` off the test's runtime thread.
pub async fn run(url: &str, args: &[&str]) -> Output {
    let mut cmd = outbox(args);
    cmd.env("DATABASE_URL", url);
    tokio::task::spawn_blocking(move || cmd.output().expect("run outbox"))
        .await
        .expect("join")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[track_caller]
pub fn assert_ok(o: &Output) {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        stdout(o),
        stderr(o)
    );
}

/// A failed run: exit code 1 and exactly one line on stderr, containing `expected`.
#[track_caller]
pub fn assert_error(o: &Output, expected: &str) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(1),
        "stdout: {}\nstderr: {err}",
        stdout(o)
    );
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains(expected), "expected `{expected}` in: {err}");
}

pub async fn emit_posted<DB: outbox_runtime::EmitDatabase>(
    pool: &sqlx::Pool<DB>,
    ledgers: usize,
    per_ledger: u32,
) -> usize {
    let events: Vec<Posted> = (0..per_ledger)
        .flat_map(|seq| {
            (0..ledgers).map(move |l| Posted {
                ledger: format!("l-{l}"),
                seq,
            })
        })
        .collect();
    for chunk in events.chunks(250) {
        let mut uow = Uow::begin(pool).await.unwrap();
        uow.emit_all(chunk).await.unwrap();
        uow.commit().await.unwrap();
    }
    events.len()
}

/// Outbox rows inserted by hand: `n` rows of `topic`, created `created_ago` and published
/// `published_ago` (`NULL` = unpublished), parked or not. Returns their ids.
pub async fn insert_rows(
    pool: &PgPool,
    topic: &str,
    n: i64,
    created_ago: &str,
    published_ago: Option<&str>,
    parked: bool,
) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
             topic, partition_key, created_at, published_at, parked_at, attempts, last_error) \
         SELECT gen_random_uuid(), 'Ledger', 'l-' || i, 'Posted', jsonb_build_object('seq', i), \
             $1, 'l-' || i, now() - $2::interval, now() - $3::interval, \
             CASE WHEN $4 THEN now() END, CASE WHEN $4 THEN 5 ELSE 0 END, \
             CASE WHEN $4 THEN 'Broker: Message size too large' END \
         FROM generate_series(1, $5) AS i RETURNING id",
    )
    .bind(topic)
    .bind(created_ago)
    .bind(published_ago)
    .bind(parked)
    .bind(n)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Reads the child's stdout lines until one contains `needle`; returns it.
pub fn wait_line(reader: &mut impl BufRead, needle: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = reader.read_line(&mut line).expect("read child stdout");
        assert!(n > 0, "the process ended before printing `{needle}`");
        if line.contains(needle) {
            return line;
        }
    }
}

pub fn signal(child: &ChildGuard, name: &str) {
    let status = Command::new("kill")
        .args([name, &child.0.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
}

/// Waits (at most `timeout`) for the child to exit; returns its exit code.
pub async fn wait_exit(child: &mut ChildGuard, timeout: Duration) -> Option<i32> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(status) = child.0.try_wait().expect("try_wait") {
            return status.code();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the process did not exit in {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
