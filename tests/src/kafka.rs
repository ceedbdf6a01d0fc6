//! Kafka for tests: librdkafka's in-process mock cluster, and `tansu`, a Kafka-protocol broker
//! run as a process of its own with SQLite storage.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use outbox_runtime::testing::MockKafka;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::TopicPartitionList;

/// A broker for one test.
pub enum Kafka {
    /// A mock cluster in the test's process (the runtime's test kit's).
    Mock(MockKafka),
    Tansu(Tansu),
}

impl std::fmt::Debug for Kafka {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kafka({})", self.bootstrap())
    }
}

/// How many brokers the mock cluster has.
const MOCK_BROKERS: u16 = 3;

impl Kafka {
    /// librdkafka's in-process mock cluster (3 brokers), with consumer groups that form at once.
    pub fn mock() -> Kafka {
        Kafka::Mock(MockKafka::with_brokers(MOCK_BROKERS).expect("start the mock Kafka cluster"))
    }

    /// A tansu broker process on a free local port.
    pub async fn tansu() -> Kafka {
        Kafka::Tansu(Tansu::start().await)
    }

    pub fn bootstrap(&self) -> String {
        match self {
            Kafka::Mock(m) => m.bootstrap_servers().to_owned(),
            Kafka::Tansu(t) => t.bootstrap(),
        }
    }

    pub async fn create_topic(&self, topic: &str, partitions: i32) {
        match self {
            Kafka::Mock(m) => m
                .create_topic(topic, partitions)
                .expect("create topic on the mock cluster"),
            Kafka::Tansu(_) => {
                let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
                    .set("bootstrap.servers", self.bootstrap())
                    .create()
                    .expect("admin client");
                let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
                // A broker still deleting the topic (or busy) answers late or refuses: asked
                // again until it creates it.
                let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
                let mut timed_out = false;
                loop {
                    let options = AdminOptions::new()
                        .operation_timeout(Some(Duration::from_secs(10)))
                        .request_timeout(Some(Duration::from_secs(15)));
                    let answer = match admin.create_topics([&new], &options).await {
                        Ok(results) => results.into_iter().next().expect("one result").map(|_| ()),
                        Err(e) => Err((
                            topic.to_owned(),
                            e.rdkafka_error_code()
                                .unwrap_or(rdkafka::types::RDKafkaErrorCode::OperationTimedOut),
                        )),
                    };
                    match answer {
                        Ok(()) => break,
                        // An earlier attempt that timed out created it after all.
                        Err((_, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists))
                            if timed_out =>
                        {
                            break
                        }
                        Err((_, code)) if tokio::time::Instant::now() < deadline => {
                            timed_out |= code
                                == rdkafka::types::RDKafkaErrorCode::OperationTimedOut
                                || code == rdkafka::types::RDKafkaErrorCode::RequestTimedOut;
                            eprintln!("creating {topic} on tansu: {code}; asking again");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                        Err((_, code)) => panic!("topic {topic} not created within 60 s: {code}"),
                    }
                }
            }
        }
    }

    /// The broker loses everything it stored (topics, records, the groups' offsets), as one
    /// whose disk was lost: the tansu process killed, its storage removed, started again
    /// empty on the same port. (Not a topic deleted and created again: tansu 0.6 under load
    /// could take over a minute to create a topic it had just deleted.)
    pub async fn lose_everything(&mut self) {
        match self {
            Kafka::Mock(_) => panic!("only tansu loses its storage"),
            Kafka::Tansu(t) => {
                t.kill();
                t.remove_storage();
                t.spawn().await;
            }
        }
    }

    /// The mock cluster answers the next produce requests with these errors, one per request
    /// (then normally again).
    pub fn fail_produce_requests(&self, errors: &[rdkafka::types::RDKafkaRespErr]) {
        match self {
            Kafka::Mock(m) => m
                .cluster()
                .request_errors(rdkafka::types::RDKafkaApiKey::Produce, errors),
            Kafka::Tansu(_) => panic!("only the mock cluster injects errors"),
        }
    }

    /// The mock cluster forgets the produce errors not yet used.
    pub fn clear_produce_errors(&self) {
        match self {
            Kafka::Mock(m) => m
                .cluster()
                .clear_request_errors(rdkafka::types::RDKafkaApiKey::Produce),
            Kafka::Tansu(_) => panic!("only the mock cluster injects errors"),
        }
    }

    /// Every mock broker answers `delay` later (a slow network or broker; zero to undo).
    pub fn set_latency(&self, delay: Duration) {
        match self {
            Kafka::Mock(m) => {
                for id in 1..=i32::from(MOCK_BROKERS) {
                    m.cluster()
                        .broker_round_trip_time(id, delay)
                        .expect("mock broker latency");
                }
            }
            Kafka::Tansu(_) => panic!("only the mock cluster injects latency"),
        }
    }

    /// Makes the broker unreachable: every mock broker down, or the tansu process killed.
    pub fn stop(&mut self) {
        match self {
            Kafka::Mock(m) => {
                for id in 1..=i32::from(MOCK_BROKERS) {
                    m.cluster().broker_down(id).expect("mock broker down");
                }
            }
            Kafka::Tansu(t) => t.kill(),
        }
    }

    /// Brings the broker back, with its data.
    pub async fn restart(&mut self) {
        match self {
            Kafka::Mock(m) => {
                for id in 1..=i32::from(MOCK_BROKERS) {
                    m.cluster().broker_up(id).expect("mock broker up");
                }
            }
            Kafka::Tansu(t) => t.spawn().await,
        }
    }
}

/// A tansu broker process. Killed when dropped.
#[derive(Debug)]
pub struct Tansu {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// Where the tansu binary is: `TANSU_BIN`, or where `.ci/install-tansu` puts it.
pub fn tansu_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("TANSU_BIN") {
        return bin.into();
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/outbox/tansu-0.6.0/bin/tansu")
}

impl Tansu {
    pub async fn start() -> Tansu {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let dir = std::env::temp_dir().join(format!("outbox-tansu-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("tansu data dir");
        let mut tansu = Tansu {
            port,
            dir,
            child: None,
        };
        tansu.spawn().await;
        tansu
    }

    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    async fn spawn(&mut self) {
        let bin = tansu_bin();
        assert!(
            bin.exists(),
            "tansu is not installed at {} (run `bash .ci/install-tansu`, or set TANSU_BIN)",
            bin.display()
        );
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let log = std::fs::File::create(self.dir.join("tansu.log")).expect("tansu log");
        let child = Command::new(bin)
            .arg("broker")
            .args(["--listener-url", &url, "--advertised-listener-url", &url])
            .args(["--storage-engine", "sqlite://tansu.db"])
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start tansu");
        self.child = Some(child);
        // Ready when it accepts connections.
        for _ in 0..200 {
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("tansu did not listen on port {} within 5 s", self.port);
    }

    /// Removes the stopped broker's storage (the SQLite database and its journal files).
    fn remove_storage(&self) {
        for entry in std::fs::read_dir(&self.dir).expect("tansu data dir") {
            let path = entry.expect("tansu data dir entry").path();
            let stored = path
                .file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("tansu.db"));
            if stored {
                std::fs::remove_file(&path).expect("remove tansu's storage");
            }
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One consumed record.
#[derive(Debug, Clone)]
pub struct Received {
    pub key: String,
    /// The value as JSON (`Null` if it is not JSON).
    pub payload: serde_json::Value,
    pub raw: Vec<u8>,
    pub headers: HashMap<String, String>,
    pub partition: i32,
    pub offset: i64,
    pub timestamp_ms: Option<i64>,
}

impl Received {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("record has no {name} header"))
    }
    pub fn outbox_id(&self) -> i64 {
        self.header("outbox_id").parse().expect("numeric outbox_id")
    }
}

/// Reads `topic` from the beginning of every partition (no consumer group) until `until` says
/// it has enough, or `timeout` passes. Returns what it read, in per-partition order.
pub async fn consume<F>(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    timeout: Duration,
    mut until: F,
) -> Vec<Received>
where
    F: FnMut(&[Received]) -> bool,
{
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("outbox-test-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("consumer");
    let mut assignment = TopicPartitionList::new();
    for p in 0..partitions {
        assignment
            .add_partition_offset(topic, p, rdkafka::Offset::Beginning)
            .expect("partition");
    }
    consumer.assign(&assignment).expect("assign");
    let mut received = Vec::new();
    let deadline = tokio::time::Instant::now() + timeout;
    while !until(&received) {
        let message = match tokio::time::timeout_at(deadline, consumer.recv()).await {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => panic!("consume error: {e}"),
            Err(_) => break,
        };
        let mut headers = HashMap::new();
        if let Some(h) = message.headers() {
            for header in h.iter() {
                let value = header
                    .value
                    .map(|v| String::from_utf8_lossy(v).into_owned());
                headers.insert(header.key.to_owned(), value.unwrap_or_default());
            }
        }
        received.push(Received {
            key: String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned(),
            payload: serde_json::from_slice(message.payload().unwrap_or_default())
                .unwrap_or(serde_json::Value::Null),
            raw: message.payload().unwrap_or_default().to_vec(),
            headers,
            partition: message.partition(),
            offset: message.offset(),
            timestamp_ms: message.timestamp().to_millis(),
        });
    }
    received
}

/// A record to produce in a test.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub key: String,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, String)>,
}

impl Outgoing {
    /// A record shaped as the relay sends an event.
    pub fn event<E: outbox_runtime::OutboxEvent + serde::Serialize>(
        event: &E,
        event_id: uuid::Uuid,
    ) -> Self {
        Outgoing {
            key: event.partition_key(),
            payload: serde_json::to_vec(event).expect("payload"),
            headers: vec![
                ("event_id".into(), event_id.to_string()),
                ("event_type".into(), E::EVENT_TYPE.into()),
                ("aggregate_type".into(), E::AGGREGATE_TYPE.into()),
                ("aggregate_id".into(), event.aggregate_id()),
                ("content-type".into(), "application/json".into()),
            ],
        }
    }
}

/// Produces the records in order and waits for every acknowledgement.
pub async fn produce(bootstrap: &str, topic: &str, records: &[Outgoing]) {
    produce_at(bootstrap, topic, None, records).await;
}

/// [`produce`] to partition `partition` (the key's, if `None`); the partition and offset of
/// each record.
pub async fn produce_at(
    bootstrap: &str,
    topic: &str,
    partition: Option<i32>,
    records: &[Outgoing],
) -> Vec<(i32, i64)> {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "0")
        .create()
        .expect("producer");
    let mut pending = Vec::with_capacity(records.len());
    for r in records {
        let mut headers = OwnedHeaders::new_with_capacity(r.headers.len());
        for (k, v) in &r.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let mut record = FutureRecord::to(topic)
            .key(r.key.as_bytes())
            .payload(&r.payload)
            .headers(headers);
        if let Some(p) = partition {
            record = record.partition(p);
        }
        pending.push(
            producer
                .send_result(record)
                .map_err(|(e, _)| e)
                .expect("enqueue"),
        );
    }
    let mut delivered = Vec::with_capacity(pending.len());
    for d in pending {
        let d = d.await.expect("delivery").expect("acknowledged");
        delivered.push((d.partition, d.offset));
    }
    delivered
}

/// Sum over the topic's partitions of the offsets `group` has committed.
pub fn committed_total(bootstrap: &str, group: &str, topic: &str, partitions: i32) -> i64 {
    use rdkafka::consumer::BaseConsumer;
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let committed = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    committed
        .elements()
        .iter()
        .map(|e| match e.offset() {
            rdkafka::Offset::Offset(o) => o,
            _ => 0,
        })
        .sum()
}
