//! The examples as a user runs them: the built example binaries, started as processes, against
//! a fresh database each (and the quickstart's embedded Kafka).
//!
//! `cargo test` builds the examples before it runs these tests; `cargo test --test quickstart`
//! alone does not, so build them first with `cargo build -p outbox-examples --examples`.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_tests::{count, database_url, url_with_database, ChildGuard, TestDb};
use serde_json::Value;
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

/// A built example: `<target>/debug/examples/<name>`, next to this test's `deps` directory.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.ancestors()
        .map(|dir| dir.join("examples").join(name))
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no built example `{name}` in the `examples` directory next to any parent of {}: \
                 run `cargo build -p outbox-examples --examples` (or the whole `cargo test`)",
                exe.display()
            )
        })
}

/// The database the quickstart creates for its payments service beside `db`, dropped (if it
/// was created) when the returned value drops, also when the test panics.
fn payments_db(db: &TestDb) -> TestDb {
    let name = format!("{}_payments", db.name);
    let url = url_with_database(&database_url(), &name);
    // Connects on first use only: the quickstart creates the database.
    let pool = PgPool::connect_lazy(&url).expect("valid database URL");
    TestDb { pool, name, url }
}

/// An example process with its output collected. Killed when dropped.
struct Running {
    child: ChildGuard,
    /// Stdout lines as they come.
    lines: mpsc::Receiver<String>,
    /// Everything it printed so far, stderr lines marked, for failure messages.
    transcript: Arc<Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Running {
    fn start(name: &str, database_url: Option<&str>, args: &[&str]) -> Running {
        Self::start_on(name, database_url, &[], args)
    }

    /// [`start`](Self::start) with these environment variables (`KAFKA_BROKERS`, `NATS_URL`;
    /// without `KAFKA_BROKERS`, the embedded Kafka).
    fn start_on(
        name: &str,
        database_url: Option<&str>,
        env: &[(&str, &str)],
        args: &[&str],
    ) -> Running {
        let mut command = Command::new(example(name));
        command
            .args(args)
            .env_remove("KAFKA_BROKERS")
            .env_remove("NATS_URL")
            .envs(env.iter().copied());
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(url) = database_url {
            command.env("DATABASE_URL", url);
        }
        let mut child = ChildGuard(command.spawn().expect("start the example"));
        let transcript = Arc::new(Mutex::new(String::new()));
        let (send, lines) = mpsc::channel();
        let stdout = child.0.stdout.take().expect("piped stdout");
        let stderr = child.0.stderr.take().expect("piped stderr");
        let readers = vec![
            Self::read(stdout, "", Some(send), transcript.clone()),
            Self::read(stderr, "stderr: ", None, transcript.clone()),
        ];
        Running {
            child,
            lines,
            transcript,
            readers,
        }
    }

    fn read(
        pipe: impl Read + Send + 'static,
        mark: &'static str,
        lines: Option<mpsc::Sender<String>>,
        transcript: Arc<Mutex<String>>,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                let mut all = transcript.lock().unwrap();
                all.push_str(mark);
                all.push_str(&line);
                all.push('\n');
                if let Some(lines) = &lines {
                    let _ = lines.send(line);
                }
            }
        })
    }

    fn transcript(&self) -> String {
        self.transcript.lock().unwrap().clone()
    }

    /// The rest of the first stdout line that starts with `prefix`.
    fn wait_for_line(&self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return rest.to_owned();
                    }
                }
                Err(_) => panic!(
                    "no line `{prefix}...` within {timeout:?}; output:\n{}",
                    self.transcript()
                ),
            }
        }
    }

    /// Waits for the process to exit and for its output to be read.
    fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.0.try_wait().expect("wait for the example") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "the example did not exit within {timeout:?}; output:\n{}",
                self.transcript()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        status
    }

    /// Sends SIGINT, as Ctrl-C in a terminal does.
    fn interrupt(&self) {
        let status = Command::new("kill")
            .args(["-INT", &self.child.0.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -INT failed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_pays_every_order_then_exits() {
    demo(200, &[], &[]).await;
}

/// The same on a Kafka-protocol broker process (tansu) given as `KAFKA_BROKERS`: topics created
/// through the admin API, real network round trips.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_on_a_broker_process_too() {
    let kafka = outbox_tests::kafka::Kafka::tansu().await;
    demo(30, &[("KAFKA_BROKERS", &kafka.bootstrap())], &[]).await;
}

/// The same through NATS JetStream (`--transport nats`, a nats-server of the test's own at
/// `NATS_URL`): the streams created by the relays and consumers, nothing else changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_on_nats_jetstream() {
    let server = outbox_tests::nats::NatsServer::start().await;
    demo(50, &[("NATS_URL", &server.url())], &["--transport", "nats"]).await;
    let js = server.jetstream().await;
    for stream in ["order_events", "payment_events"] {
        let mut stream = js
            .get_stream(stream)
            .await
            .expect("the stream the relay created");
        let held = stream.info().await.unwrap().state.messages;
        assert_eq!(
            held,
            50,
            "{} holds every order's event",
            stream.cached_info().config.name
        );
    }
}

/// The same through RabbitMQ (`--transport rabbitmq`, a node of the test's own at
/// `RABBITMQ_URL`): exchanges and each group's shard queues declared by the relays and
/// consumers, and every shard queue read to the end once the demo is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_on_rabbitmq() {
    let node = outbox_tests::rabbitmq::RabbitNode::start().await;
    demo(
        50,
        &[("RABBITMQ_URL", &node.url())],
        &["--transport", "rabbitmq"],
    )
    .await;
    let rabbitmq = outbox_runtime::rabbitmq::RabbitMq::new(node.url());
    for (topic, group) in [
        ("order.events", "quickstart-payments"),
        ("payment.events", "quickstart-orders"),
    ] {
        let queues = rabbitmq
            .queues(&[topic.to_owned()], &[group.to_owned()])
            .await
            .unwrap();
        assert!(!queues.is_empty());
        for queue in queues {
            assert!(queue.exists, "{queue:?}");
            assert_eq!(queue.messages, Some(0), "read to the end: {queue:?}");
        }
    }
}

/// The same on MariaDB (`--database mariadb`): the services' tables and outboxes there, both
/// consumers in dedup mode, one payment per order, the timed-out charges paid on their second
/// attempt, one trace per order across both services.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_on_mariadb() {
    mariadb_demo(None).await;
}

/// The same on MariaDB through NATS JetStream (a nats-server of the test's own): each
/// consumer group reads its topic under a lease in its service's database, given up when the
/// demo stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_on_mariadb_through_jetstream() {
    let server = outbox_tests::nats::NatsServer::start().await;
    mariadb_demo(Some(&server.url())).await;
}

/// `--demo 40 --database mariadb`, through JetStream at `nats` if given (else Kafka's mock
/// cluster): see [`demo_runs_on_mariadb`].
async fn mariadb_demo(nats: Option<&str>) {
    use outbox_tests::mysql::{count, MySqlTestDb};

    let n = 40;
    let db = MySqlTestDb::empty().await;
    // The quickstart creates it; dropped with the guard, also when the test panics.
    let payments = MySqlTestDb {
        name: format!("{}_payments", db.name),
        url: url_with_database(
            &outbox_tests::mysql::mysql_url(),
            &format!("{}_payments", db.name),
        ),
        pool: sqlx::MySqlPool::connect_lazy(&db.url).expect("valid database URL"),
    };
    let demo = n.to_string();
    let mut args = vec![
        "--demo",
        &demo,
        "--listen",
        "127.0.0.1:0",
        "--trace",
        "--database",
        "mariadb",
    ];
    let mut env = Vec::new();
    if let Some(url) = nats {
        args.extend_from_slice(&["--transport", "nats"]);
        env.push(("NATS_URL", url));
    }
    let mut quickstart = Running::start_on("quickstart", Some(&db.url), &env, &args);
    let status = quickstart.wait(Duration::from_secs(120));
    let output = quickstart.transcript();
    assert!(
        status.success(),
        "quickstart failed: {status}; output:\n{output}"
    );
    assert!(
        output.contains(&format!("demo: {n}/{n} orders paid in ")),
        "no demo result line; output:\n{output}"
    );
    assert!(
        output.contains("orders handler, the round trip (then dedup mode): p50 "),
        "{output}"
    );

    let orders = &db.pool;
    let paid = "SELECT COUNT(*) FROM orders WHERE payment_status = 'paid'";
    assert_eq!(count(orders, paid).await, n);
    let published = "SELECT COUNT(*) FROM outbox_event \
                     WHERE event_type = 'OrderCreated' AND published_at IS NOT NULL";
    assert_eq!(count(orders, published).await, n);
    let handled = "SELECT COUNT(*) FROM processed_event";
    assert_eq!(
        count(orders, handled).await,
        n,
        "the orders consumer's dedup rows"
    );

    let payments_pool = sqlx::MySqlPool::connect(&payments.url).await.unwrap();
    let p = &payments_pool;
    assert_eq!(
        count(p, "SELECT COUNT(DISTINCT order_id) FROM payments").await,
        n
    );
    assert_eq!(count(p, "SELECT COUNT(*) FROM payments").await, n);
    let published = "SELECT COUNT(*) FROM outbox_event \
                     WHERE event_type = 'PaymentSucceeded' AND published_at IS NOT NULL";
    assert_eq!(count(p, published).await, n);
    assert_eq!(
        count(p, "SELECT COUNT(DISTINCT provider_charge) FROM payments").await,
        n
    );
    assert_eq!(
        count(p, "SELECT COUNT(*) FROM payments WHERE attempt = 2").await,
        n / 10
    );

    // One trace per order, across both services' outboxes.
    let traces = |pool: sqlx::MySqlPool, event_type: &'static str| async move {
        sqlx::query_as::<_, (String, String)>(
            "SELECT CAST(JSON_UNQUOTE(JSON_EXTRACT(payload, '$.order_id')) AS CHAR), \
                    CAST(JSON_UNQUOTE(JSON_EXTRACT(headers, '$.traceparent')) AS CHAR) \
             FROM outbox_event WHERE event_type = ?",
        )
        .bind(event_type)
        .fetch_all(&pool)
        .await
        .unwrap()
        .into_iter()
        .collect::<std::collections::BTreeMap<String, String>>()
    };
    let created = traces(orders.clone(), "OrderCreated").await;
    let succeeded = traces(payments_pool.clone(), "PaymentSucceeded").await;
    assert_eq!(created.len() as i64, n);
    let trace_of = |tp: &String| tp.split('-').nth(1).unwrap().to_owned();
    for (order, tp) in &created {
        assert_eq!(trace_of(tp), trace_of(&succeeded[order]), "order {order}");
    }
    if nats.is_some() {
        // Each group read its topic under a lease in its own database, released at the stop.
        for (pool, group, topic) in [
            (orders, "quickstart-orders", "payment.events"),
            (p, "quickstart-payments", "order.events"),
        ] {
            let leases = outbox_runtime::mysql::status(pool)
                .await
                .unwrap()
                .consumer_leases;
            assert_eq!(leases.len(), 1, "{leases:?}");
            let lease = &leases[0];
            assert_eq!((lease.group.as_str(), lease.topic.as_str()), (group, topic));
            assert_eq!((lease.owned, lease.expires_in_secs), (false, None));
        }
    }
    payments_pool.close().await;
    drop(payments);
}

/// `--database mariadb` refuses what is not built there yet, saying so, before it touches a
/// database.
#[test]
fn mariadb_refuses_the_console() {
    for (args, expected) in [
        (
            &["--database", "mariadb", "--console", "127.0.0.1:0"][..],
            "`--console` is not built on MariaDB",
        ),
        (
            &["--database", "oracle"][..],
            "`--database oracle`: postgres or mariadb",
        ),
    ] {
        let mut run = Running::start("quickstart", Some("mysql://nobody@127.0.0.1:1/none"), args);
        let status = run.wait(Duration::from_secs(30));
        let output = run.transcript();
        assert!(!status.success(), "{args:?}: {output}");
        assert!(output.contains(expected), "{args:?}: {output}");
    }
}

/// `--demo n`: exits successfully with every order paid, and the databases agree.
async fn demo(n: i64, env: &[(&str, &str)], args: &[&str]) {
    let db = TestDb::empty().await;
    let payments = payments_db(&db);
    let started = Instant::now();
    let demo = n.to_string();
    let mut all_args = vec!["--demo", &demo, "--listen", "127.0.0.1:0", "--trace"];
    all_args.extend_from_slice(args);
    let mut quickstart = Running::start_on("quickstart", Some(&db.url), env, &all_args);
    let status = quickstart.wait(Duration::from_secs(120));
    let output = quickstart.transcript();
    assert!(
        status.success(),
        "quickstart failed: {status}; output:\n{output}"
    );
    assert!(
        output.contains(&format!("demo: {n}/{n} orders paid in ")),
        "no demo result line; output:\n{output}"
    );
    for handler in ["payments handler", "orders handler"] {
        let line = output
            .lines()
            .find(|l| l.starts_with("demo: order committed -> ") && l.contains(handler))
            .unwrap_or_else(|| panic!("no latency line for the {handler}; output:\n{output}"));
        assert!(line.contains(" p50 ") && line.contains(" p99 "), "{line}");
    }
    eprintln!(
        "quickstart --demo {n} ran {:.1?}:\n{output}",
        started.elapsed()
    );

    // Orders side: every order paid, every OrderCreated published, every payment received.
    let orders = &db.pool;
    assert_eq!(count(orders, "SELECT count(*) FROM orders").await, n);
    let paid = "SELECT count(*) FROM orders WHERE payment_status = 'paid'";
    assert_eq!(count(orders, paid).await, n);
    let published = "SELECT count(*) FROM outbox_event \
                     WHERE event_type = 'OrderCreated' AND published_at IS NOT NULL";
    assert_eq!(count(orders, published).await, n);
    let received = "SELECT count(*) FROM inbox_event WHERE processed";
    assert_eq!(count(orders, received).await, n);

    // Payments side, its own database: one payment per order, each PaymentSucceeded published.
    let payments_pool = &payments.pool;
    assert_eq!(
        count(payments_pool, "SELECT count(*) FROM payments").await,
        n
    );
    let distinct = "SELECT count(DISTINCT order_id) FROM payments";
    assert_eq!(count(payments_pool, distinct).await, n);
    let published = "SELECT count(*) FROM outbox_event \
                     WHERE event_type = 'PaymentSucceeded' AND published_at IS NOT NULL";
    assert_eq!(count(payments_pool, published).await, n);
    // The provider (in the consumer's state) timed out on every tenth new charge: those orders
    // were paid on their second attempt (read from the metadata), with the charge the first
    // attempt made (the event id is the idempotency key): one charge per order.
    let charges = "SELECT count(DISTINCT provider_charge) FROM payments";
    assert_eq!(count(payments_pool, charges).await, n);
    let retried = "SELECT count(*) FROM payments WHERE attempt = 2";
    assert_eq!(count(payments_pool, retried).await, n / 10);
    let first = "SELECT count(*) FROM payments WHERE attempt = 1";
    assert_eq!(count(payments_pool, first).await, n - n / 10);

    // One trace per order, across both services: the request's trace context was stored with
    // OrderCreated, and the payments handler's span (its child) with PaymentSucceeded.
    let traces = |sql: &'static str, pool: PgPool| async move {
        sqlx::query_as::<_, (String, String)>(sql)
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .map(|(order, tp)| (order, tp.split('-').nth(1).unwrap().to_owned()))
            .collect::<std::collections::BTreeMap<String, String>>()
    };
    let created = traces(
        "SELECT payload->>'order_id', headers->>'traceparent' FROM outbox_event \
         WHERE event_type = 'OrderCreated'",
        orders.clone(),
    )
    .await;
    let succeeded = traces(
        "SELECT payload->>'order_id', headers->>'traceparent' FROM outbox_event \
         WHERE event_type = 'PaymentSucceeded'",
        payments_pool.clone(),
    )
    .await;
    assert_eq!(created.len() as i64, n);
    assert_eq!(succeeded, created);
    // And `--trace` printed each order's spans under its trace id: the request, the payments
    // consumer's handler and the provider call it made, the orders consumer's handler.
    for trace in created.values() {
        let names: Vec<&str> = output
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("stderr: span trace={trace} ")))
            .filter_map(|l| l.split(' ').nth(2))
            .collect();
        for name in [
            "POST",
            "outbox_consume",
            "provider_charge",
            "outbox_inbox_row",
        ] {
            assert!(
                names.contains(&name),
                "trace {trace} has no `{name}` span: {names:?}"
            );
        }
    }
    payments_pool.close().await;
}

/// One HTTP/1.1 request on a connection of its own; returns the status and the JSON body.
async fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{method} {path}: not a JSON answer:\n{head}"
    );
    let json = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("{method} {path}: body is not JSON ({e}): {body:?}"));
    (status, json)
}

/// One GET of a console page: its status and HTML.
async fn page(addr: &str, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    let request = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    (status, response)
}

/// Asserts an error answer: `status` and `{"error": "<non-empty>"}`.
async fn expect_error(addr: &str, method: &str, path: &str, body: Option<&str>, status: u16) {
    let (got, json) = http(addr, method, path, body).await;
    assert_eq!(
        got, status,
        "{method} {path} {body:?} answered {got}: {json}"
    );
    let message = json["error"].as_str().unwrap_or_default();
    assert!(
        !message.is_empty(),
        "{method} {path}: no error message in {json}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_api_answers_errors_as_json_and_ctrl_c_stops_it() {
    let db = TestDb::empty().await;
    let _payments = payments_db(&db);
    let mut quickstart = Running::start(
        "quickstart",
        Some(&db.url),
        &["--listen", "127.0.0.1:0", "--console", "127.0.0.1:0"],
    );
    let addr = quickstart.wait_for_line("orders API listening on http://", Duration::from_secs(60));
    let console = quickstart.wait_for_line("outbox console on http://", Duration::from_secs(10));
    let console = console.split('/').next().unwrap().to_owned();

    let order = |amount: &str| {
        format!(r#"{{"customer_id": "c-1", "product_id": "book-42", "amount": {amount}}}"#)
    };
    expect_error(&addr, "POST", "/orders", Some(r#"{"customer_id": "#), 400).await;
    expect_error(&addr, "POST", "/orders", Some(&order("0")), 422).await;
    expect_error(&addr, "POST", "/orders", Some(&order("-5")), 422).await;
    expect_error(&addr, "POST", "/orders", Some(&order(r#""ten""#)), 422).await;
    expect_error(&addr, "POST", "/orders", Some(r#"{"amount": 10}"#), 422).await;
    expect_error(&addr, "GET", "/orders/not-a-uuid", None, 400).await;
    let unknown = format!("/orders/{}", Uuid::now_v7());
    expect_error(&addr, "GET", &unknown, None, 404).await;
    expect_error(&addr, "GET", "/nothing-here", None, 404).await;

    let (status, created) = http(&addr, "POST", "/orders", Some(&order("1500"))).await;
    assert_eq!(status, 201, "valid order answered {status}: {created}");
    let id = created["order_id"]
        .as_str()
        .expect("order_id in the answer");
    let path = format!("/orders/{id}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, order) = http(&addr, "GET", &path, None).await;
        assert_eq!(status, 200, "GET {path} answered {status}: {order}");
        assert_eq!(order["amount"], 1500);
        match order["payment_status"].as_str() {
            Some("paid") => break,
            Some("pending") => {}
            other => panic!("unexpected payment_status {other:?} in {order}"),
        }
        assert!(
            Instant::now() < deadline,
            "order not paid within 30 s; output:\n{}",
            quickstart.transcript()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The console beside it shows both services' outboxes: the order's event, published.
    for (path, topic) in [("/orders", "order.events"), ("/payments", "payment.events")] {
        let (status, page) = page(&console, path).await;
        assert_eq!(status, 200, "GET {path} on the console: {page}");
        assert!(
            page.contains(&format!("data-topic=\"{topic}\"")),
            "the console at {path} shows no `{topic}`: {page}"
        );
    }
    let (status, page) = page(&console, "/payments/parked").await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("0 rows match"), "{page}");

    let stopping = Instant::now();
    quickstart.interrupt();
    let status = quickstart.wait(Duration::from_secs(30));
    let output = quickstart.transcript();
    assert!(
        status.success(),
        "quickstart exited with {status} after Ctrl-C; output:\n{output}"
    );
    assert!(
        output.contains("stopped"),
        "no clean stop; output:\n{output}"
    );
    eprintln!("quickstart stopped {:.1?} after SIGINT", stopping.elapsed());
}

#[test]
fn expanded_prints_what_the_written_out_impl_returns() {
    let mut expanded = Running::start("expanded", None, &[]);
    let status = expanded.wait(Duration::from_secs(30));
    let output = expanded.transcript();
    assert!(
        status.success(),
        "expanded failed: {status}; output:\n{output}"
    );
    for expected in [
        "TOPIC            order.events",
        "AGGREGATE_TYPE   Order",
        "EVENT_TYPE       OrderCreated",
        "aggregate_id()   0190a1b2-c3d4-7e5f-8a6b-1c2d3e4f5a6b",
        "partition_key()  customer-42",
        "event_id()       Some(0190a1b2-c3d4-7000-8000-000000000001)",
        concat!(
            r#"payload_json()   {"order_id":"0190a1b2-c3d4-7e5f-8a6b-1c2d3e4f5a6b","#,
            r#""customer_id":"customer-42","event_id":"0190a1b2-c3d4-7000-8000-000000000001","#,
            r#""amount":1500}"#
        ),
        "outbox row: event_id=0190a1b2-c3d4-7000-8000-000000000001 topic=order.events",
    ] {
        assert!(
            output.lines().any(|line| line.starts_with(expected)),
            "no line `{expected}`; output:\n{output}"
        );
    }
}
