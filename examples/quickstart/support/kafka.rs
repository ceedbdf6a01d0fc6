//! Where the broker comes from: `KAFKA_BROKERS`, or librdkafka's mock cluster inside this
//! process (the runtime's [`MockKafka`]).

use std::time::Duration;

use outbox_runtime::testing::MockKafka;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientConfig;

use super::Result;

/// Partitions of each topic the quickstart creates.
const PARTITIONS: i32 = 4;

/// The Kafka the services talk through.
pub enum Kafka {
    /// librdkafka's mock cluster of one broker, inside this process (consumer groups form at
    /// once); gone when this value drops.
    Mock(MockKafka),
    /// `KAFKA_BROKERS`.
    External(String),
}

impl Kafka {
    /// `KAFKA_BROKERS` or a new mock cluster, with `topics` created.
    pub async fn start(topics: &[&str]) -> Result<Kafka> {
        let kafka = match std::env::var("KAFKA_BROKERS") {
            Ok(brokers) if !brokers.is_empty() => {
                create_topics(&brokers, topics).await?;
                Kafka::External(brokers)
            }
            _ => Kafka::mock(topics)?,
        };
        println!("Kafka at {}", kafka.bootstrap_servers());
        Ok(kafka)
    }

    /// A mock cluster of one broker, with `topics`.
    fn mock(topics: &[&str]) -> Result<Kafka> {
        let mock = MockKafka::start()?;
        for topic in topics {
            mock.create_topic(topic, PARTITIONS)?;
        }
        Ok(Kafka::Mock(mock))
    }

    /// A consumer's settings: the mock's (a short fetch wait: see [`MockKafka`]), or only the
    /// brokers of `KAFKA_BROKERS`.
    pub fn consumer_config(&self) -> ClientConfig {
        match self {
            Kafka::Mock(mock) => mock.consumer_config(),
            Kafka::External(brokers) => {
                let mut config = ClientConfig::new();
                config.set("bootstrap.servers", brokers);
                config
            }
        }
    }

    /// What relays and consumers connect to.
    pub fn bootstrap_servers(&self) -> &str {
        match self {
            Kafka::Mock(mock) => mock.bootstrap_servers(),
            Kafka::External(brokers) => brokers,
        }
    }
}

/// Creates `topics` on a real Kafka; topics that exist already are fine.
async fn create_topics(brokers: &str, topics: &[&str]) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|topic| NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results =
        tokio::time::timeout(Duration::from_secs(30), admin.create_topics(&new, &options))
            .await
            .map_err(|_| format!("Kafka at {brokers} did not answer within 30 s"))?
            .map_err(|e| format!("cannot create topics on Kafka at {brokers}: {e}"))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => return Err(format!("cannot create topic {topic}: {code}").into()),
        }
    }
    Ok(())
}
