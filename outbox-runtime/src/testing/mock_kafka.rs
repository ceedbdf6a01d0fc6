//! [`MockKafka`]: librdkafka's mock cluster, the one wrapper every part of this project uses
//! (the test kit, the workspace's tests, `outbox dev-broker`, the quickstart).

use std::ffi::CString;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, DefaultProducerContext, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use super::first_header;
use crate::error::{Error, Result};
use crate::relay::Relay;

/// A record [`MockKafka::records`] read.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// Its partition.
    pub partition: i32,
    /// Its offset in the partition.
    pub offset: i64,
    /// Its key.
    pub key: Option<Vec<u8>>,
    /// Its value.
    pub payload: Option<Vec<u8>>,
    /// Its headers, in order (the relay's own first: `event_id`, `event_type`,
    /// `aggregate_type`, `aggregate_id`, `content-type`, `outbox_id`; then the event's).
    pub headers: Vec<(String, String)>,
}

impl Record {
    /// The value of its first header named `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        first_header(&self.headers, name)
    }
}

/// librdkafka's mock cluster, in the test's process and memory: a Kafka that real clients
/// (the relay, consumers, the test's own) talk to over the Kafka protocol on local ports.
/// Consumer groups form at once (the cluster's default initial rebalance delay is 3 s, as
/// Kafka's). Dropped, it is gone.
///
/// A fetch that finds nothing is answered only when the consumer's fetch wait
/// (`fetch.wait.max.ms`, librdkafka's default 500 ms) has passed, even if records arrive
/// meanwhile (Apache Kafka answers as soon as they do): with the defaults, a consumer of the
/// mock gets a record up to 500 ms after it was produced. A consumer given
/// [`consumer_config`](Self::consumer_config) waits at most [`FETCH_WAIT`](Self::FETCH_WAIT).
///
/// When a group's last member leaves, the mock lets the next one in only after the leaving
/// member's session timeout (librdkafka's default: 45 s); Apache Kafka, after its initial
/// rebalance delay (3 s). A consumer given [`consumer_config`](Self::consumer_config) has a
/// session timeout of [`SESSION_TIMEOUT`](Self::SESSION_TIMEOUT), so that a consumer of a
/// group started again reads within seconds.
///
/// It does not check idempotent producers' sequence numbers (see
/// [`RelayBuilder::one_record_in_flight_per_key`](crate::relay::RelayBuilder::one_record_in_flight_per_key)).
pub struct MockKafka {
    /// The client whose mock cluster this is: the cluster lives as long as it does.
    owner: BaseProducer,
    bootstrap: String,
}

impl std::fmt::Debug for MockKafka {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockKafka")
            .field("bootstrap", &self.bootstrap)
            .finish_non_exhaustive()
    }
}

impl MockKafka {
    /// The fetch wait of a consumer of the mock cluster ([`consumer_config`](Self::consumer_config),
    /// and the most that `outbox dev-broker` lets a fetch wait): 5 ms, so that a record is
    /// handled within milliseconds of its publishing, as on Apache Kafka. An idle consumer
    /// fetches 200 times a second from each broker it reads, in memory.
    pub const FETCH_WAIT: Duration = Duration::from_millis(5);

    /// The session timeout of a consumer of the mock cluster ([`consumer_config`](Self::consumer_config),
    /// and the longest that `outbox dev-broker` lets a member ask for): 10 s, so that a
    /// group's next member, after the last one left, is let in 9 s later rather than 44 s. A
    /// member that has not heartbeated for that long is dropped from its group; librdkafka
    /// heartbeats every 3 s, from a thread of its own.
    pub const SESSION_TIMEOUT: Duration = Duration::from_secs(10);

    /// Starts a mock cluster of one broker.
    pub fn start() -> Result<Self> {
        Self::with_brokers(1)
    }

    /// Starts a mock cluster of `brokers` brokers (ids 1 to `brokers`): partitions' leaders
    /// spread over them, so that a test can take one down or slow it
    /// ([`cluster`](Self::cluster)).
    pub fn with_brokers(brokers: u16) -> Result<Self> {
        let owner: BaseProducer = ClientConfig::new()
            .set("test.mock.num.brokers", brokers.max(1).to_string())
            .create()
            .map_err(|source| Error::KafkaClient {
                client: "mock cluster",
                source,
            })?;
        let native = native_cluster(&owner)?;
        // SAFETY: `native` is the live mock cluster of `owner`, which outlives the call.
        unsafe { rdkafka_sys::rd_kafka_mock_group_initial_rebalance_delay_ms(native, 0) };
        let bootstrap = owner
            .client()
            .mock_cluster()
            .map(|c| c.bootstrap_servers())
            .ok_or_else(no_cluster)?;
        Ok(MockKafka { owner, bootstrap })
    }

    /// Makes broker `broker` tell clients that it is at `host:port` (clients connect to what
    /// brokers advertise, after the bootstrap): for a forwarder in front of the cluster, such
    /// as `outbox dev-broker`'s fixed port.
    pub fn advertise(&self, broker: u16, host: &str, port: u16) -> Result<()> {
        let host = CString::new(host)
            .map_err(|_| Error::Config(format!("a host name with a NUL byte: {host:?}")))?;
        let native = native_cluster(&self.owner)?;
        // SAFETY: `native` is the live mock cluster of `self.owner`; the host string outlives
        // the call, which copies it.
        unsafe {
            rdkafka_sys::rd_kafka_mock_broker_set_host_port(
                native,
                i32::from(broker),
                host.as_ptr(),
                i32::from(port),
            );
        }
        Ok(())
    }

    /// Its bootstrap servers, for `brokers(...)` of a relay or consumer.
    pub fn bootstrap_servers(&self) -> &str {
        &self.bootstrap
    }

    /// The settings of a consumer of this cluster: its bootstrap servers, and a fetch wait of
    /// [`FETCH_WAIT`](Self::FETCH_WAIT) (`fetch.wait.max.ms`; see [`MockKafka`]). For
    /// `consumer_config(...)` of a consumer's builder, or any Kafka client.
    pub fn consumer_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.bootstrap)
            .set(
                "fetch.wait.max.ms",
                Self::FETCH_WAIT.as_millis().to_string(),
            )
            .set(
                "session.timeout.ms",
                Self::SESSION_TIMEOUT.as_millis().to_string(),
            );
        config
    }

    /// Creates `topic` with `partitions` partitions.
    pub fn create_topic(&self, topic: &str, partitions: i32) -> Result<()> {
        Ok(self.cluster().create_topic(topic, partitions, 1)?)
    }

    /// Publishes the unpublished outbox rows of `pool` with a relay (the real one: the same
    /// producer settings, batches and per-key order), and returns how many it published. It is
    /// one relay instance: with no other relay running on the database it owns every shard and
    /// publishes every row; beside a running relay it takes its share only.
    /// `pool` is PostgreSQL's or MariaDB/MySQL's (`&pool`, or the pool).
    pub async fn relay_pending(&self, pool: impl Into<crate::relay::Database>) -> Result<u64> {
        Relay::builder(pool)
            .brokers(self.bootstrap.clone())
            .build()?
            .publish_pending()
            .await
    }

    /// Every record of `topic`, in order per partition (partitions in order).
    pub async fn records(&self, topic: &str) -> Result<Vec<Record>> {
        let config = {
            let mut config = ClientConfig::new();
            config
                .set("bootstrap.servers", &self.bootstrap)
                .set("group.id", "outbox-testing")
                .set("enable.auto.commit", "false")
                .set("enable.partition.eof", "true")
                // Each partition's end is an empty fetch: waited for FETCH_WAIT, not 500 ms.
                .set(
                    "fetch.wait.max.ms",
                    Self::FETCH_WAIT.as_millis().to_string(),
                );
            config
        };
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || read_all(&config, &topic))
            .await
            .map_err(|source| Error::Task {
                task: "the mock cluster's reader",
                source,
            })?
    }

    /// The cluster itself, to inject errors or latency, take brokers down and up
    /// (`rdkafka::mocking`).
    pub fn cluster(&self) -> MockCluster<'_, DefaultProducerContext> {
        self.owner
            .client()
            .mock_cluster()
            .expect("the owner client was created with a mock cluster")
    }
}

fn no_cluster() -> Error {
    Error::KafkaClient {
        client: "mock cluster",
        source: KafkaError::MockCluster(RDKafkaErrorCode::Fail),
    }
}

/// The native handle of `owner`'s mock cluster.
fn native_cluster(owner: &BaseProducer) -> Result<*mut rdkafka_sys::rd_kafka_mock_cluster_t> {
    // SAFETY: the pointer is `owner`'s live client handle.
    let native = unsafe { rdkafka_sys::rd_kafka_handle_mock_cluster(owner.client().native_ptr()) };
    if native.is_null() {
        Err(no_cluster())
    } else {
        Ok(native)
    }
}

/// Reads `topic` from the beginning to its end, blocking: an unknown topic is an error, and a
/// partition that does not reach its end within 30 s fails the read (with the last error).
fn read_all(config: &ClientConfig, topic: &str) -> Result<Vec<Record>> {
    let consumer: BaseConsumer = config.create()?;
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let mut partitions = Vec::new();
    for t in metadata.topics() {
        if let Some(code) = t.error() {
            return Err(KafkaError::MetadataFetch(code.into()).into());
        }
        partitions.extend(t.partitions().iter().map(|p| p.id()));
    }
    if partitions.is_empty() {
        return Err(KafkaError::MetadataFetch(RDKafkaErrorCode::UnknownTopicOrPartition).into());
    }
    let mut assignment = TopicPartitionList::new();
    for &p in &partitions {
        assignment.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    let mut records = Vec::new();
    let mut at_end = std::collections::HashSet::new();
    let mut last_error = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while at_end.len() < partitions.len() {
        if std::time::Instant::now() >= deadline {
            return Err(last_error
                .unwrap_or(KafkaError::MessageConsumption(
                    RDKafkaErrorCode::OperationTimedOut,
                ))
                .into());
        }
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => records.push(Record {
                partition: m.partition(),
                offset: m.offset(),
                key: m.key().map(<[u8]>::to_vec),
                payload: m.payload().map(<[u8]>::to_vec),
                headers: headers(&m),
            }),
            Some(Err(KafkaError::PartitionEOF(p))) => {
                at_end.insert(p);
            }
            // Passing (a broker connection being set up): tried again until the deadline.
            Some(Err(e)) => last_error = Some(e),
            None => {}
        }
    }
    records.sort_by_key(|r| (r.partition, r.offset));
    Ok(records)
}

fn headers(message: &impl Message) -> Vec<(String, String)> {
    use rdkafka::message::Headers;
    message
        .headers()
        .map(|h| {
            h.iter()
                .filter_map(|h| {
                    Some((
                        h.key.to_owned(),
                        String::from_utf8_lossy(h.value?).into_owned(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default()
}
