//! NATS JetStream for the tests: a `nats-server` process of a test's own (a port and a store
//! directory of its own, so that tests running side by side never share a stream), which a
//! test can kill and start again, and what reads a stream back as the Kafka tests' records.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream::{self, stream};

use crate::kafka::Received;

/// Where the `nats-server` binary is: `NATS_SERVER_BIN`, or Debian's.
pub fn nats_server_bin() -> PathBuf {
    std::env::var_os("NATS_SERVER_BIN")
        .map_or_else(|| PathBuf::from("/usr/sbin/nats-server"), PathBuf::from)
}

/// A `nats-server` with JetStream, killed (and its store removed) when dropped.
#[derive(Debug)]
pub struct NatsServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl NatsServer {
    pub async fn start() -> NatsServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let dir = std::env::temp_dir().join(format!("outbox-nats-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("nats store dir");
        let mut server = NatsServer {
            port,
            dir,
            child: None,
        };
        server.spawn().await;
        server
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// A client of this server that reconnects for ever (a relay's, across restarts).
    pub async fn client(&self) -> async_nats::Client {
        async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(self.url())
            .await
            .expect("connect to nats-server")
    }

    pub async fn jetstream(&self) -> jetstream::Context {
        jetstream::new(self.client().await)
    }

    /// Starts the server (again, with its store: what JetStream had synced is still there).
    pub async fn spawn(&mut self) {
        let bin = nats_server_bin();
        assert!(
            bin.exists(),
            "nats-server is not installed at {} (Debian's package nats-server, or set \
             NATS_SERVER_BIN)",
            bin.display()
        );
        let log = std::fs::File::create(self.dir.join("nats.log")).expect("nats log");
        let child = Command::new(bin)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js"])
            .arg("-sd")
            .arg(self.dir.join("store"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        // Ready once JetStream answers (it recovers its streams before it does).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(client) = async_nats::connect(self.url()).await {
                // The account's information as JSON (async-nats's `Account` does not read a
                // 2.9 server's).
                let info = client.request("$JS.API.INFO", "".into()).await;
                if info.is_ok_and(|m| !String::from_utf8_lossy(&m.payload).contains("\"error\"")) {
                    return;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "nats-server on port {} did not answer within 20 s",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// SIGKILL: gone at once, no goodbye to its clients.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, and waits for the server to exit: a graceful stop.
    pub fn terminate(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
    }

    /// A stream named `name` capturing `subject`, with `tweak` applied to its settings.
    pub async fn create_stream(
        &self,
        name: &str,
        subject: &str,
        tweak: impl FnOnce(&mut stream::Config),
    ) {
        let mut config = stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.to_owned()],
            ..Default::default()
        };
        tweak(&mut config);
        self.jetstream()
            .await
            .create_stream(config)
            .await
            .expect("create stream");
    }

    /// Publishes `records` to `subject` in order, each as the relay sends an event (its key in
    /// `outbox_key`; no `Nats-Msg-Id`, so that a record sent twice is stored twice), and waits
    /// for each acknowledgement.
    pub async fn publish(&self, subject: &str, records: &[crate::kafka::Outgoing]) {
        publish_with(&self.jetstream().await, subject, records).await;
    }

    /// Messages of the stream `stream` that the durable consumer `durable` has not settled:
    /// not delivered yet, and delivered but not acknowledged (nor terminated). `None` while
    /// the consumer does not exist.
    pub async fn unsettled(&self, stream: &str, durable: &str) -> Option<(u64, usize)> {
        let js = self.jetstream().await;
        let stream = js.get_stream(stream).await.ok()?;
        let info = stream.consumer_info(durable).await.ok()?;
        Some((info.num_pending, info.num_ack_pending))
    }

    /// Fetches up to `n` messages for the durable consumer `durable` of stream `stream` and
    /// goes away without acknowledging any, as a consumer that crashed; returns once the
    /// server's wait for them (the consumer's `ack_wait`) ran out, so that it delivers them
    /// again. Returns their stream sequences, in the order delivered.
    pub async fn fetch_and_go_away(&self, stream: &str, durable: &str, n: usize) -> Vec<u64> {
        use futures_util::StreamExt;
        let js = self.jetstream().await;
        let stream = js.get_stream(stream).await.expect("the stream");
        let consumer: jetstream::consumer::PullConsumer = stream
            .get_consumer(durable)
            .await
            .expect("the durable consumer");
        let mut messages = consumer
            .fetch()
            .max_messages(n)
            .messages()
            .await
            .expect("fetch");
        let mut sequences = Vec::new();
        while let Some(message) = messages.next().await {
            sequences.push(
                message
                    .expect("a message")
                    .info()
                    .expect("its info")
                    .stream_sequence,
            );
        }
        let ack_wait = consumer.cached_info().config.ack_wait;
        // The server looks for expired deliveries on a timer of its own: a margin past it.
        tokio::time::sleep(ack_wait + ack_wait / 2).await;
        sequences
    }

    /// Every message the stream `name` holds, in its order, as the Kafka tests' records: the
    /// key from `outbox_key`, the timestamp from `outbox_timestamp_ms`, the stream sequence as
    /// the offset.
    pub async fn read_stream(&self, name: &str) -> Vec<Received> {
        let js = self.jetstream().await;
        let mut stream = js.get_stream(name).await.expect("stream");
        let state = stream.info().await.expect("stream info").state.clone();
        let mut out = Vec::new();
        for sequence in state.first_sequence..=state.last_sequence {
            let message = match stream.get_raw_message(sequence).await {
                Ok(message) => message,
                // Removed (a limit, a purge): not there to read.
                Err(_) => continue,
            };
            out.push(received(&message));
        }
        out
    }

    /// Reads the stream `name` through a durable pull consumer of its own (`durable`),
    /// acknowledging each message (on a work-queue stream, what makes room for more), until
    /// `expected` messages were read or `timeout` passes: what it read, in the stream's order.
    pub async fn take_from_stream(
        &self,
        name: &str,
        durable: &str,
        expected: usize,
        timeout: Duration,
    ) -> Vec<Received> {
        use futures_util::StreamExt;
        let js = self.jetstream().await;
        let stream = js.get_stream(name).await.expect("stream");
        let consumer = stream
            .get_or_create_consumer(
                durable,
                jetstream::consumer::pull::Config {
                    durable_name: Some(durable.to_owned()),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ..Default::default()
                },
            )
            .await
            .expect("pull consumer");
        let deadline = tokio::time::Instant::now() + timeout;
        let mut out = Vec::new();
        while out.len() < expected && tokio::time::Instant::now() < deadline {
            let mut batch = consumer
                .fetch()
                .max_messages(100)
                .expires(Duration::from_millis(200))
                .messages()
                .await
                .expect("fetch");
            while let Some(message) = batch.next().await {
                let message = message.expect("message");
                let sequence = message.info().expect("a JetStream message").stream_sequence;
                let mut record = received_parts(message.headers.as_ref(), &message.payload);
                record.offset = sequence as i64;
                out.push(record);
                message.ack().await.expect("ack");
            }
        }
        out
    }

    /// Waits until the stream `name` holds `expected` messages (or `timeout` passes), then
    /// reads them.
    pub async fn read_stream_when(
        &self,
        name: &str,
        expected: u64,
        timeout: Duration,
    ) -> Vec<Received> {
        let js = self.jetstream().await;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let held = match js.get_stream(name).await {
                Ok(mut s) => s.info().await.map_or(0, |i| i.state.messages),
                Err(_) => 0,
            };
            if held >= expected || tokio::time::Instant::now() >= deadline {
                return self.read_stream(name).await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// [`NatsServer::publish`] through `js` (a connection of the caller's own, e.g. in a task).
pub async fn publish_with(
    js: &jetstream::Context,
    subject: &str,
    records: &[crate::kafka::Outgoing],
) {
    for record in records {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("outbox_key", record.key.as_str());
        for (name, value) in &record.headers {
            headers.append(name.as_str(), value.as_str());
        }
        js.publish_with_headers(subject.to_owned(), headers, record.payload.clone().into())
            .await
            .expect("publish")
            .await
            .expect("publish acknowledged");
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn received(message: &jetstream::message::StreamMessage) -> Received {
    let mut record = received_parts(Some(&message.headers), &message.payload);
    record.offset = message.sequence as i64;
    record
}

fn received_parts(headers: Option<&async_nats::HeaderMap>, payload: &[u8]) -> Received {
    let headers: HashMap<String, String> = headers
        .into_iter()
        .flat_map(|h| h.iter())
        .filter_map(|(name, values)| {
            values
                .first()
                .map(|v| (name.to_string(), v.as_str().to_owned()))
        })
        .collect();
    Received {
        key: headers.get("outbox_key").cloned().unwrap_or_default(),
        payload: serde_json::from_slice(payload).unwrap_or(serde_json::Value::Null),
        raw: payload.to_vec(),
        timestamp_ms: headers
            .get("outbox_timestamp_ms")
            .and_then(|t| t.parse().ok()),
        headers,
        partition: 0,
        offset: 0,
    }
}

/// async-nats alone, for benchmarks: a durable consumer `name` of its own on `stream`, its `n`
/// messages pulled and acknowledged; their rate from the first (JetStream's ceiling).
pub async fn raw_jetstream(server: &NatsServer, stream: &str, name: &str, n: usize) -> f64 {
    use futures_util::StreamExt as _;
    let js = server.jetstream().await;
    let stream = js.get_stream(stream).await.unwrap();
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some(name.to_owned()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            max_ack_pending: 500,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(500)
        .messages()
        .await
        .unwrap();
    messages.next().await.unwrap().unwrap().ack().await.unwrap();
    let start = std::time::Instant::now();
    for _ in 1..n {
        messages.next().await.unwrap().unwrap().ack().await.unwrap();
    }
    crate::bench::rate(n as u64 - 1, start.elapsed())
}

/// Checks a dead letter of a payment read from `stream` (on the payments' subject): its
/// reason, its attempts and where it was read.
pub fn assert_dead_letter(letter: &Received, stream: &str, reason: &str, attempts: &str) {
    assert!(
        letter.header("dlq_error").contains(reason),
        "{} does not say {reason}",
        letter.header("dlq_error")
    );
    assert_eq!(letter.header("dlq_attempts"), attempts);
    assert_eq!(letter.header("dlq_source_topic"), crate::fixtures::PAYMENTS);
    assert_eq!(letter.header("dlq_source_partition"), "0");
    assert_eq!(letter.header("dlq_source_stream"), stream);
    assert!(letter.header("dlq_source_offset").parse::<u64>().unwrap() >= 1);
}
