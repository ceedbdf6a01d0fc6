//! Errors and ends: bad arguments and unreachable services (clear messages, exit codes), and a
//! closed stdout.

use std::process::Stdio;

use outbox_tests::TestDb;

use crate::support::{assert_error, assert_ok, insert_rows, outbox, run, stderr, TOPIC};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_give_clear_errors() {
    let db = TestDb::empty().await;
    // Usage errors: clap's message and exit code 2.
    let url = db.url.clone();
    let usage = |args: &'static [&'static str], expected: &'static str| {
        let url = url.clone();
        async move {
            let o = run(&url, args).await;
            assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
            assert!(stderr(&o).contains(expected), "{args:?}: {}", stderr(&o));
        }
    };
    usage(&["frobnicate"], "unrecognized subcommand").await;
    usage(
        &["cleanup", "--older-than", "30x"],
        "invalid duration `30x`",
    )
    .await;
    usage(&["cleanup"], "--older-than").await;
    usage(
        &[
            "replay",
            "--topic",
            "t",
            "--brokers",
            "b",
            "--since",
            "last tuesday",
        ],
        "invalid time",
    )
    .await;
    usage(
        &["relay", "--brokers", "b", "--instances", "0"],
        "--instances",
    )
    .await;
    usage(
        &["relay", "--brokers", "b", "-X", "acks"],
        "expected key=value",
    )
    .await;

    let no_url = tokio::task::spawn_blocking(|| outbox(&["status"]).output().unwrap())
        .await
        .unwrap();
    assert_eq!(no_url.status.code(), Some(2));
    assert!(
        stderr(&no_url).contains("--database-url"),
        "{}",
        stderr(&no_url)
    );

    // Runtime errors: one line, exit code 1.
    assert_error(
        &run("postgres://postgres@127.0.0.1:1/x", &["status"]).await,
        "cannot connect to PostgreSQL at 127.0.0.1:1/x",
    );
    assert_error(&run("not a url", &["status"]).await, "invalid database URL");
    assert_error(&run(&db.url, &["status"]).await, "run `outbox migrate`");
    assert_ok(&run(&db.url, &["migrate"]).await);
    assert_error(
        &run(
            &db.url,
            &[
                "relay",
                "--brokers",
                "127.0.0.1:9",
                "-X",
                "enable.idempotence=false",
            ],
        )
        .await,
        "must be idempotent",
    );
    insert_rows(&db.pool, TOPIC, 1, "1 hour", Some("1 hour"), false).await;
    assert_error(
        &run(
            &db.url,
            &["replay", "--topic", TOPIC, "--brokers", "127.0.0.1:9"],
        )
        .await,
        "cannot reach Kafka at 127.0.0.1:9",
    );
}

/// `outbox status | head -1`: the reader is gone before anything is written. Like any Unix
/// filter, the command ends as if its output had been read: exit 0, nothing on stderr.
#[tokio::test]
async fn a_closed_stdout_is_an_ordinary_end() {
    let db = TestDb::new().await;
    insert_rows(&db.pool, "a.events", 3, "1 hour", None, false).await;
    insert_rows(&db.pool, "a.events", 2, "2 hours", None, true).await;
    for args in [
        &["status"][..],
        &["status", "--json"],
        &["parked", "list"],
        &["inbox", "dead", "list"],
        &["migrate"],
    ] {
        let mut cmd = outbox(args);
        cmd.env("DATABASE_URL", &db.url)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let out = tokio::task::spawn_blocking(move || {
            let mut child = cmd.spawn().expect("run outbox");
            // Closed before the command has even connected to the database.
            drop(child.stdout.take());
            child.wait_with_output().expect("wait")
        })
        .await
        .expect("join");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        assert_eq!(stderr(&out), "", "{args:?}");
    }
}
