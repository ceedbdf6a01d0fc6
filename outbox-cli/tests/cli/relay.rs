//! `relay`: several instances, a graceful stop on SIGTERM, Prometheus metrics, JSON logs and
//! RUST_LOG.

use std::io::BufReader;
use std::process::Stdio;
use std::time::Duration;

use outbox_tests::kafka::{consume, Kafka};
use outbox_tests::{ChildGuard, TestDb};

use crate::support::{
    assert_error, count, emit_posted, insert_rows, outbox, run, signal, stderr, stdout, wait_exit,
    wait_line, TOPIC,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_command_runs_several_instances_and_stops_on_sigterm() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 4).await;
    // Rows published 40 days ago: the relay's retention (30 days) deletes them.
    insert_rows(&db.pool, TOPIC, 25, "41 days", Some("40 days"), false).await;
    let mut cmd = outbox(&[
        "relay",
        "--instances",
        "3",
        "--poll-interval",
        "100ms",
        "--retention",
        "30d",
    ]);
    cmd.env("DATABASE_URL", &db.url)
        .env("KAFKA_BROKERS", kafka.bootstrap())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = ChildGuard(cmd.spawn().expect("start relay"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let started = tokio::task::spawn_blocking(move || {
        let line = wait_line(&mut out, "outbox relay:");
        (line, out)
    });
    let (line, mut out) = started.await.unwrap();
    assert!(line.contains("3 instance(s)"), "{line}");

    let total = emit_posted(&db.pool, 30, 10).await;
    let received = consume(&kafka.bootstrap(), TOPIC, 4, Duration::from_secs(30), |r| {
        r.len() >= total
    })
    .await;
    assert_eq!(received.len(), total);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = run(&db.url, &["status", "--json"]).await;
        let status: serde_json::Value = serde_json::from_str(&stdout(&status)).unwrap();
        if status["relay_instances"] == 3 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "3 relay instances: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_event WHERE published_at IS NULL"
        )
        .await,
        0
    );
    while count(&db.pool, "SELECT count(*) FROM outbox_event").await != total as i64 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the old published rows deleted by the relay's retention"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    signal(&child, "-TERM");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(20)).await,
        Some(0)
    );
    let rest = tokio::task::spawn_blocking(move || wait_line(&mut out, "stopped"))
        .await
        .unwrap();
    assert!(rest.contains("0 unpublished"), "{rest}");
}

/// `GET path` on `addr`: the status line and the body, or `None` while nothing answers.
fn get(addr: &str, path: &str) -> Option<(String, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    Some((head.lines().next()?.to_owned(), body.to_owned()))
}

/// `GET /metrics` on `addr`: the body, or `None` while nothing answers.
fn scrape(addr: &str) -> Option<String> {
    let (status, body) = get(addr, "/metrics")?;
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    Some(body)
}

/// The value of an unlabelled sample in a Prometheus text exposition.
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_serves_prometheus_metrics_and_probes_and_logs_json_filtered_by_rust_log() {
    let db = TestDb::new().await;
    let mut kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 4).await;
    let addr = format!(
        "127.0.0.1:{}",
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    );
    let mut cmd = outbox(&[
        "relay",
        "--metrics-addr",
        &addr,
        "--log-format",
        "json",
        "--poll-interval",
        "100ms",
    ]);
    cmd.env("DATABASE_URL", &db.url)
        .env("KAFKA_BROKERS", kafka.bootstrap())
        // The relay's batch records are debug lines: shown only because RUST_LOG asks.
        .env("RUST_LOG", "info,outbox_runtime::relay=debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = ChildGuard(cmd.spawn().expect("start relay"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let err = child.0.stderr.take().unwrap();
    tokio::task::spawn_blocking(move || wait_line(&mut out, "outbox relay:"))
        .await
        .unwrap();

    let total = emit_posted(&db.pool, 10, 10).await;
    consume(&kafka.bootstrap(), TOPIC, 4, Duration::from_secs(30), |r| {
        r.len() >= total
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let metrics = loop {
        let scraped = {
            let addr = addr.clone();
            tokio::task::spawn_blocking(move || scrape(&addr))
                .await
                .unwrap()
        };
        if let Some(m) = scraped.filter(|m| {
            sample(m, "outbox_relay_published_total").is_some_and(|n| n >= total as f64)
        }) {
            break m;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{total} published in the scraped metrics"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        sample(&metrics, "outbox_relay_published_total"),
        Some(total as f64),
        "{metrics}"
    );
    assert!(
        metrics.contains("# TYPE outbox_relay_published_total counter"),
        "{metrics}"
    );

    // The probes beside the metrics: alive, and ready while the database and the broker answer
    // and the relay owns shards; not ready, saying why, once the broker is gone.
    let probe = |path: &'static str| {
        let addr = addr.clone();
        tokio::task::spawn_blocking(move || get(&addr, path).expect("the endpoint answers"))
    };
    assert_eq!(
        probe("/health").await.unwrap(),
        ("HTTP/1.1 200 OK".to_owned(), "ok\n".to_owned())
    );
    assert_eq!(
        probe("/ready").await.unwrap(),
        (
            "HTTP/1.1 200 OK".to_owned(),
            "ready: the database and the broker answer; 1 instance(s) own shards\n".to_owned()
        )
    );
    assert_eq!(probe("/nothing").await.unwrap().0, "HTTP/1.1 404 Not Found");
    kafka.stop();
    // The broker's last answer is kept a few seconds: wait for the probe to see it gone.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let (status, body) = loop {
        let (status, body) = probe("/ready").await.unwrap();
        if status != "HTTP/1.1 200 OK" {
            break (status, body);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still ready: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(status, "HTTP/1.1 503 Service Unavailable", "{body}");
    assert!(body.starts_with("not ready: the broker: "), "{body}");
    // The brokers stay down: the relay stops without them. (Bringing a mock broker up binds
    // its old port again, which another test's connection may have taken meanwhile, and
    // librdkafka then aborts the whole test process: it did once in CI.)

    signal(&child, "-TERM");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(20)).await,
        Some(0)
    );
    let mut logs = String::new();
    std::io::Read::read_to_string(&mut BufReader::new(err), &mut logs).unwrap();
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let messages = |level: &str| -> Vec<String> {
        lines
            .iter()
            .filter(|l| l["level"] == level)
            .filter_map(|l| l["fields"]["message"].as_str().map(str::to_owned))
            .collect()
    };
    assert!(
        messages("INFO").iter().any(|m| m == "outbox relay started"),
        "{logs}"
    );
    assert!(
        messages("DEBUG")
            .iter()
            .any(|m| m == "outbox relay batch recorded"),
        "{logs}"
    );
}

#[tokio::test]
async fn an_invalid_rust_log_is_a_clear_error() {
    let mut cmd = outbox(&["status", "--database-url", "postgres://127.0.0.1:1/none"]);
    cmd.env("RUST_LOG", "outbox_runtime=loud");
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).starts_with("error: invalid RUST_LOG: "),
        "{}",
        stderr(&out)
    );
}

/// `outbox relay --nats-url`: publishes to JetStream (creating the stream with
/// `--create-streams`), with KAFKA_BROKERS set and ignored, and stops on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_command_publishes_to_jetstream() {
    let db = TestDb::new().await;
    let server = outbox_tests::nats::NatsServer::start().await;
    let mut cmd = outbox(&[
        "relay",
        "--nats-url",
        &server.url(),
        "--create-streams",
        "--poll-interval",
        "100ms",
    ]);
    cmd.env("DATABASE_URL", &db.url)
        .env("KAFKA_BROKERS", "127.0.0.1:1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = ChildGuard(cmd.spawn().expect("start relay"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let started = tokio::task::spawn_blocking(move || {
        let line = wait_line(&mut out, "outbox relay:");
        (line, out)
    });
    let (line, mut out) = started.await.unwrap();
    assert!(
        line.contains(&format!("JetStream at {}", server.url())),
        "{line}"
    );
    let total = emit_posted(&db.pool, 20, 5).await;
    // `ledger.events` gets the stream `ledger_events`.
    let received = server
        .read_stream_when("ledger_events", total as u64, Duration::from_secs(30))
        .await;
    assert_eq!(received.len(), total);
    signal(&child, "-TERM");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(20)).await,
        Some(0)
    );
    let rest = tokio::task::spawn_blocking(move || wait_line(&mut out, "stopped"))
        .await
        .unwrap();
    assert!(rest.contains("0 unpublished"), "{rest}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_command_says_when_nats_is_not_there() {
    let db = TestDb::new().await;
    let out = run(&db.url, &["relay", "--nats-url", "nats://127.0.0.1:1"]).await;
    assert_error(&out, "cannot connect to NATS at nats://127.0.0.1:1");
}
