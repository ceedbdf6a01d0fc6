//! `dev-broker`: the mock cluster on a fixed port, used by a relay and a reader.

use std::io::BufReader;
use std::process::Stdio;
use std::time::Duration;

use outbox_runtime::relay::Relay;
use outbox_tests::kafka::consume;
use outbox_tests::{ChildGuard, TestDb};

use crate::support::{emit_posted, outbox, signal, wait_exit, wait_line, TOPIC};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_broker_serves_kafka_on_a_fixed_port() {
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
        "3",
        "--topic",
        "demo.events",
    ]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = ChildGuard(cmd.spawn().expect("start dev broker"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let (line, _out) =
        tokio::task::spawn_blocking(move || (wait_line(&mut out, "listening on"), out))
            .await
            .unwrap();
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
