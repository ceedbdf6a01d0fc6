//! `outbox dev-broker`: librdkafka's in-memory mock cluster on a fixed local port.
//!
//! The mock cluster listens on a port the kernel picks; this command listens on the asked port,
//! forwards each connection to the mock broker, and makes the broker advertise the asked port,
//! so that clients only ever see `127.0.0.1:<port>`.

use std::ffi::CString;

use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseProducer, Producer};
use tokio::net::{TcpListener, TcpStream};

use crate::commands::Shutdown;

pub async fn run(port: u16, partitions: i32, topics: &[String]) -> Result<(), String> {
    let listener = TcpListener::bind(("127.0.0.1", port)).await.map_err(|e| {
        format!("cannot listen on 127.0.0.1:{port}: {e} (another broker? pick another --port)")
    })?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    let owner: BaseProducer = ClientConfig::new()
        .set("test.mock.num.brokers", "1")
        .create()
        .map_err(|e| format!("cannot start the mock cluster: {e}"))?;
    let cluster = owner
        .client()
        .mock_cluster()
        .ok_or("the mock cluster did not start")?;
    // The broker's real address, before it advertises the forwarded one.
    let upstream = cluster.bootstrap_servers();
    let host = CString::new("127.0.0.1").map_err(|e| e.to_string())?;
    // SAFETY: the pointer is the live mock cluster of `owner`, which outlives these calls; the
    // host string outlives the call that copies it.
    unsafe {
        let native = rdkafka_sys::rd_kafka_handle_mock_cluster(owner.client().native_ptr());
        if native.is_null() {
            return Err("the mock cluster did not start".into());
        }
        // Consumer groups form at once (the default initial rebalance delay is 3 s).
        rdkafka_sys::rd_kafka_mock_group_initial_rebalance_delay_ms(native, 0);
        rdkafka_sys::rd_kafka_mock_broker_set_host_port(native, 1, host.as_ptr(), i32::from(port));
    }
    for topic in topics {
        cluster
            .create_topic(topic, partitions, 1)
            .map_err(|e| format!("cannot create topic `{topic}`: {e}"))?;
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
            let (mut client, _) = match listener.accept().await {
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
                    Ok(mut broker) => {
                        let _ = client.set_nodelay(true);
                        let _ = broker.set_nodelay(true);
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut broker).await;
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
    drop(cluster);
    owner.flush(std::time::Duration::from_millis(100)).ok();
    eprintln!("dev broker stopped");
    Ok(())
}
