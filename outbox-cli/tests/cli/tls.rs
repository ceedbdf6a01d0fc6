//! TLS: to PostgreSQL (`sslmode`, every session, the server verified) and SASL_SSL settings to
//! Kafka.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use outbox_tests::kafka::Kafka;
use outbox_tests::{ChildGuard, TestDb};

use crate::support::{assert_error, assert_ok, outbox, run, signal, wait_exit, wait_line, TOPIC};

/// `url` with `params` added to its query string.
fn with_params(url: &str, params: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{params}")
}

/// Makes sure the server takes TLS connections: turns `ssl` on (a reload, which nothing else
/// notices, and which stays) if it is off and a certificate is configured, as on Debian's and
/// the official images' servers.
async fn require_server_tls(db: &TestDb) {
    let ssl: String = sqlx::query_scalar("SHOW ssl")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    if ssl == "on" {
        return;
    }
    sqlx::query("ALTER SYSTEM SET ssl = on")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&db.pool)
        .await
        .unwrap();
    // The reload is a signal: new sessions see it once the postmaster has read the files.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let fresh = db.pool(1).await;
        let ssl: String = sqlx::query_scalar("SHOW ssl")
            .fetch_one(&fresh)
            .await
            .unwrap();
        if ssl == "on" {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server does not turn ssl on: is a certificate configured (ssl_cert_file)?"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_talks_tls_to_postgres_and_verifies_the_server() {
    let db = TestDb::new().await;
    require_server_tls(&db).await;

    // TLS required: works, and every session of the command is encrypted.
    let tls = with_params(&db.url, "sslmode=require&application_name=outbox-over-tls");
    assert_ok(&run(&tls, &["status"]).await);
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 1).await;
    let mut cmd = outbox(&["relay"]);
    cmd.env("DATABASE_URL", &tls)
        .env("KAFKA_BROKERS", kafka.bootstrap())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = ChildGuard(cmd.spawn().expect("start relay"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    tokio::task::spawn_blocking(move || wait_line(&mut out, "outbox relay:"))
        .await
        .unwrap();
    let (sessions, encrypted): (i64, Option<bool>) = sqlx::query_as(
        "SELECT count(*), bool_and(s.ssl) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.application_name = 'outbox-over-tls'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(sessions >= 1, "the relay's sessions");
    assert_eq!(encrypted, Some(true), "every session of the relay is TLS");
    signal(&child, "-TERM");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(20)).await,
        Some(0)
    );

    // The server is verified when asked: a local server's certificate is self-signed (no
    // trusted CA signed it) and names a host, never 127.0.0.1, so `verify-full` to 127.0.0.1
    // is refused.
    assert!(db.url.contains("@127.0.0.1:"), "{}", db.url);
    assert_error(
        &run(&with_params(&db.url, "sslmode=verify-full"), &["status"]).await,
        "cannot connect to PostgreSQL",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_passes_sasl_ssl_settings_to_kafka() {
    let db = TestDb::new().await;
    // Nothing listens there: the relay starts (librdkafka took the settings) and keeps trying.
    let nowhere = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let secured = [
        "-X",
        "security.protocol=SASL_SSL",
        "-X",
        "sasl.mechanisms=SCRAM-SHA-512",
        "-X",
        "sasl.username=relay",
        "-X",
        "sasl.password=secret",
    ];
    let mut cmd = outbox(&[&["relay", "--brokers", &nowhere][..], &secured].concat());
    cmd.env("DATABASE_URL", &db.url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = ChildGuard(cmd.spawn().expect("start relay"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let mut err = child.0.stderr.take().unwrap();
    let started = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        line
    })
    .await
    .unwrap();
    if !started.contains("outbox relay:") {
        let mut logs = String::new();
        std::io::Read::read_to_string(&mut err, &mut logs).unwrap();
        panic!("the relay did not start with SASL_SSL settings: {logs}");
    }
    signal(&child, "-TERM");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(20)).await,
        Some(0)
    );

    // A mechanism librdkafka does not know is refused when the producer is created.
    let mut cmd = outbox(&[
        "relay",
        "--brokers",
        &nowhere,
        "-X",
        "security.protocol=SASL_SSL",
        "-X",
        "sasl.mechanisms=NO-SUCH-MECHANISM",
    ]);
    cmd.env("DATABASE_URL", &db.url);
    let refused = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    assert_error(&refused, "cannot create the Kafka producer");
}
