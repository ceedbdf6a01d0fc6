//! `outbox dev-broker`: librdkafka's in-memory mock cluster on a fixed local port.
//!
//! The mock cluster listens on a port the kernel picks; this command listens on the asked port,
//! forwards each connection to the mock broker, and makes the broker advertise the asked port,
//! so that clients only ever see `127.0.0.1:<port>`. On the way it caps each fetch's wait and
//! each group member's session timeout (`forward.rs`), where the mock would otherwise keep a
//! consumer waiting where Apache Kafka does not.

mod forward;

use outbox_runtime::testing::MockKafka;
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpStream};

use super::chain;
use crate::shutdown::Shutdown;

pub async fn run(port: u16, partitions: i32, topics: &[String]) -> Result<(), String> {
    let listener = TcpListener::bind(("127.0.0.1", port)).await.map_err(|e| {
        format!("cannot listen on 127.0.0.1:{port}: {e} (another broker? pick another --port)")
    })?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    let kafka = MockKafka::start().map_err(|e| format!("cannot start the mock cluster: {e}"))?;
    // The broker's real address, before it advertises the forwarded one.
    let upstream = kafka.bootstrap_servers().to_owned();
    kafka
        .advertise(1, "127.0.0.1", port)
        .map_err(|e| format!("cannot start the mock cluster: {e}"))?;
    for topic in topics {
        kafka
            .create_topic(topic, partitions)
            .map_err(|e| format!("cannot create topic `{topic}`: {}", chain(e)))?;
    }
    let shutdown = Shutdown::listen();
    out!("dev broker (librdkafka mock cluster, in memory) listening on 127.0.0.1:{port}");
    out!("  export KAFKA_BROKERS=127.0.0.1:{port}");
    if !topics.is_empty() {
        out!(
            "  created {} with {partitions} partitions; other topics are created on first use",
            topics.join(", ")
        );
    }
    out!("  everything is lost when it stops; stop with Ctrl-C");
    let accept = async {
        loop {
            let (client, _) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors, say: wait a little instead of spinning.
                    tracing::warn!(error = %e, "dev broker: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let upstream = upstream.clone();
            tokio::spawn(async move {
                match TcpStream::connect(upstream.as_str()).await {
                    Ok(broker) => {
                        let _ = client.set_nodelay(true);
                        let _ = broker.set_nodelay(true);
                        let (client_reads, mut client_writes) = client.into_split();
                        let (mut broker_reads, broker_writes) = broker.into_split();
                        let answers = async {
                            tokio::io::copy(&mut broker_reads, &mut client_writes).await?;
                            client_writes.shutdown().await
                        };
                        let requests = forward::forward_requests(client_reads, broker_writes);
                        let _ = tokio::try_join!(requests, answers);
                    }
                    Err(e) => tracing::warn!(error = %e, "dev broker: mock broker unreachable"),
                }
            });
        }
    };
    tokio::select! {
        () = accept => {}
        () = shutdown.received() => {}
    }
    drop(kafka);
    eprintln!("dev broker stopped");
    Ok(())
}
