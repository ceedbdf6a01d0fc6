//! `outbox console`: its settings' errors, and the console it serves acting on the database
//! until SIGTERM. (The pages themselves are tested in a browser: `tests/tests/console.rs`.)

use std::io::BufReader;
use std::process::Stdio;
use std::time::Duration;

use outbox_tests::{count, ChildGuard, TestDb};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{assert_error, outbox, run, signal, stderr, wait_exit, wait_line};

const TOKEN: &str = "cli-console-token-0123456789";

/// One HTTP/1.1 request: the status and the whole response.
async fn request(addr: &str, method: &str, path: &str, headers: &str, body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{headers}\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status");
    (status, response)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_refuses_unsafe_settings_and_serves_until_sigterm() {
    let db = TestDb::new().await;
    let no_token = run(&db.url, &["console", "--allow-actions"]).await;
    assert_error(&no_token, "--allow-actions needs a token");
    let unused = run(&db.url, &["console", "--token", TOKEN]).await;
    assert_error(&unused, "a token without --allow-actions guards nothing");
    let short = run(&db.url, &["console", "--allow-actions", "--token", "short"]).await;
    assert_error(&short, "at least 16 characters");
    let bad = run(&db.url, &["console", "--listen", "localhost"]).await;
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));

    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key, attempts, last_error, parked_at) \
         VALUES (gen_random_uuid(), 'Ledger', 'l-1', 'Posted', '{}', 'ledger.events', 'l-1', 3, \
                 'refused', now())",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let id: i64 = sqlx::query_scalar("SELECT id FROM outbox_event")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let mut cmd = outbox(&["console", "--listen", "127.0.0.1:0", "--allow-actions"]);
    cmd.env("DATABASE_URL", &db.url)
        .env("OUTBOX_CONSOLE_TOKEN", TOKEN)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = ChildGuard(cmd.spawn().expect("start the console"));
    let mut err = BufReader::new(child.0.stderr.take().unwrap());
    let (line, err) = tokio::task::spawn_blocking(move || {
        let line = wait_line(&mut err, "outbox console on http://");
        (line, err)
    })
    .await
    .unwrap();
    assert!(
        line.contains("actions allowed") && line.contains("only this machine"),
        "{line}"
    );
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .expect("the address")
        .to_owned();

    let (status, page) = request(&addr, "GET", "/", "", "").await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("data-topic=\"ledger.events\""), "{page}");
    let (status, _) = request(
        &addr,
        "POST",
        "/parked/retry",
        "",
        &format!("id={id}&confirmed=1"),
    )
    .await;
    assert_eq!(status, 401);
    let bearer = format!("Authorization: Bearer {TOKEN}\r\n");
    let (status, page) = request(
        &addr,
        "POST",
        "/parked/retry",
        &bearer,
        &format!("id={id}&confirmed=1"),
    )
    .await;
    assert_eq!(status, 303, "{page}");
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_event WHERE parked_at IS NOT NULL"
        )
        .await,
        0
    );

    signal(&child, "-TERM");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(10)).await,
        Some(0)
    );
    drop(err);
}
