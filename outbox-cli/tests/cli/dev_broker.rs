//! `dev-broker`: the mock cluster on a fixed port, used by a relay and a reader.

use std::io::BufReader;
use std::process::Stdio;
use std::time::Duration;

use outbox_runtime::relay::Relay;
use outbox_tests::kafka::consume;
use outbox_tests::{ChildGuard, TestDb};

use crate::support::{emit_posted, outbox, signal, wait_exit, wait_line, TOPIC};

/// `outbox dev-broker` on a free port with `partitions` partitions of `topic`, once it says it
/// listens: the process, its port, that line, and its standard output (kept open).
async fn start(
    partitions: u32,
    topic: &str,
) -> (
    ChildGuard,
    u16,
    String,
    BufReader<std::process::ChildStdout>,
) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cmd = outbox(&[
        "dev-broker",
        "--port",
        &port.to_string(),
        "--partitions",
        &partitions.to_string(),
        "--topic",
        topic,
    ]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = ChildGuard(cmd.spawn().expect("start dev broker"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let (line, out) =
        tokio::task::spawn_blocking(move || (wait_line(&mut out, "listening on"), out))
            .await
            .unwrap();
    (child, port, line, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_broker_serves_kafka_on_a_fixed_port() {
    let (mut child, port, line, _out) = start(3, "demo.events").await;
    let bootstrap = format!("127.0.0.1:{port}");
    assert!(line.contains(&bootstrap), "{line}");

    // A relay publishes through it, and a reader gets the events back.
    let db = TestDb::new().await;
    emit_posted(&db.pool, 3, 4).await;
    let relay = Relay::builder(db.pool.clone())
        .brokers(&bootstrap)
        .build()
        .unwrap();
    assert_eq!(relay.publish_pending().await.unwrap(), 12);
    let received = consume(&bootstrap, TOPIC, 4, Duration::from_secs(30), |r| {
        r.len() >= 12
    })
    .await;
    assert_eq!(received.len(), 12);
    // The topic created at start has the asked partitions; the broker advertises the port.
    let metadata = tokio::task::spawn_blocking(move || {
        let client: rdkafka::producer::BaseProducer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .create()
            .unwrap();
        let m = rdkafka::producer::Producer::client(&client)
            .fetch_metadata(Some("demo.events"), Duration::from_secs(10))
            .unwrap();
        (
            m.topics()[0].partitions().len(),
            m.brokers().iter().map(|b| b.port()).collect::<Vec<_>>(),
        )
    })
    .await
    .unwrap();
    assert_eq!(metadata, (3, vec![i32::from(port)]));

    signal(&child, "-INT");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(10)).await,
        Some(0)
    );
}

/// Record `n` of the dev broker's tests: key `key-<n>`, payload `n`.
fn record(n: u32) -> outbox_tests::kafka::Outgoing {
    outbox_tests::kafka::Outgoing {
        key: format!("key-{n}"),
        payload: n.to_string().into_bytes(),
        headers: Vec::new(),
    }
}

/// The mock answers a fetch that found nothing only when the client's fetch wait has passed;
/// the dev broker caps that wait, so a consumer gets a record produced while its fetch waits
/// as from Kafka: at once, whatever its own fetch wait (here two minutes, which the test's
/// 30 s bound would see).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_broker_answers_a_waiting_fetch_when_a_record_arrives() {
    use rdkafka::consumer::{Consumer as _, StreamConsumer};
    use rdkafka::Message as _;

    let (mut child, port, _line, _out) = start(1, "wait.events").await;
    let bootstrap = format!("127.0.0.1:{port}");
    outbox_tests::kafka::produce(&bootstrap, "wait.events", &[record(1)]).await;

    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("group.id", "waiting")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", "120000")
        .set("socket.timeout.ms", "125000")
        .create()
        .unwrap();
    consumer.subscribe(&["wait.events"]).unwrap();
    let recv = || {
        let payload = async {
            let message = consumer.recv().await.expect("a record");
            message.payload().map(<[u8]>::to_vec)
        };
        tokio::time::timeout(Duration::from_secs(30), payload)
    };
    let first = recv().await.expect("the first record within 30 s");
    assert_eq!(first.as_deref(), Some(&b"1"[..]));
    // Its next fetch finds nothing and waits; the second record arrives meanwhile.
    outbox_tests::kafka::produce(&bootstrap, "wait.events", &[record(2)]).await;
    let second = recv()
        .await
        .expect("the second record within 30 s, not at the end of the consumer's fetch wait");
    assert_eq!(second.as_deref(), Some(&b"2"[..]));

    drop(consumer);
    signal(&child, "-INT");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(10)).await,
        Some(0)
    );
}

/// When a group's last member leaves, the mock keeps the group rebalancing for the member's
/// session timeout (librdkafka's default: 45 s, less a second) before it lets the next one in;
/// Apache Kafka lets it in after its initial rebalance delay (3 s). The dev broker caps the session timeout the mock is told, so a consumer
/// restarted in development reads again within seconds, whatever its own session timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_broker_lets_a_restarted_consumer_of_a_group_in_within_seconds() {
    use rdkafka::consumer::{Consumer as _, StreamConsumer};

    let (mut child, port, _line, _out) = start(1, "restart.events").await;
    let bootstrap = format!("127.0.0.1:{port}");
    outbox_tests::kafka::produce(&bootstrap, "restart.events", &[record(1)]).await;
    let member = || {
        let consumer: StreamConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", "restarting")
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap();
        consumer.subscribe(&["restart.events"]).unwrap();
        consumer
    };
    let first = member();
    tokio::time::timeout(Duration::from_secs(30), first.recv())
        .await
        .expect("the first member reads within 30 s")
        .unwrap();
    drop(first); // closes: leaves the group
    let second = member();
    // Whatever the first member committed, the second reads what comes after it left.
    outbox_tests::kafka::produce(&bootstrap, "restart.events", &[record(2)]).await;
    tokio::time::timeout(Duration::from_secs(30), second.recv())
        .await
        .expect("the restarted member reads within 30 s, not after the first one's session timeout")
        .unwrap();

    drop(second);
    signal(&child, "-INT");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(10)).await,
        Some(0)
    );
}
