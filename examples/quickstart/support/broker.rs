//! The broker between the services: Kafka ([`Kafka`]: `KAFKA_BROKERS` or an embedded mock
//! cluster), NATS JetStream (`--transport nats`, at `NATS_URL`) or RabbitMQ (`--transport
//! rabbitmq`, at `RABBITMQ_URL`). Relays and consumers are built the same way on each: only their broker setting differs ([`Broker::relay`],
//! [`Broker::consumer`]).

use std::time::Duration;

use outbox_runtime::inbox::{ConsumerBuilder, ConsumerDatabase};
use outbox_runtime::rabbitmq::RabbitMq;
use outbox_runtime::relay::{JetStream, RelayBuilder};

use super::args::Transport;
use super::kafka::Kafka;
use super::Result;

pub enum Broker {
    Kafka(Kafka),
    JetStream(JetStream),
    RabbitMq(RabbitMq),
}

impl Broker {
    /// The broker `transport` names: Kafka with `topics` created, or JetStream at `NATS_URL`,
    /// whose streams the relays and consumers create as they need them.
    pub async fn start(transport: Transport, topics: &[&str]) -> Result<Broker> {
        match transport {
            Transport::Kafka => Ok(Broker::Kafka(Kafka::start(topics).await?)),
            Transport::Nats => {
                let url = std::env::var("NATS_URL")
                    .ok()
                    .filter(|url| !url.is_empty())
                    .unwrap_or_else(|| "nats://127.0.0.1:4222".to_owned());
                let connecting = outbox_runtime::async_nats::connect(url.as_str());
                let client = tokio::time::timeout(Duration::from_secs(10), connecting)
                    .await
                    .map_err(|_| format!("nats-server at {url} did not answer within 10 s"))?
                    .map_err(|e| format!("cannot connect to nats-server at {url}: {e}"))?;
                println!("NATS JetStream at {url}");
                Ok(Broker::JetStream(
                    JetStream::new(client).create_streams(true),
                ))
            }
            Transport::RabbitMq => {
                let url = std::env::var("RABBITMQ_URL")
                    .ok()
                    .filter(|url| !url.is_empty())
                    .unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5672".to_owned());
                let rabbitmq = RabbitMq::new(url);
                // The consumers declare their queues when they start; the relays publish
                // only once a queue is bound (until then their events are held, not lost).
                println!("RabbitMQ at {}", rabbitmq.url_for_display());
                Ok(Broker::RabbitMq(rabbitmq))
            }
        }
    }

    /// A relay publishing to this broker.
    pub fn relay(&self, relay: RelayBuilder) -> RelayBuilder {
        match self {
            Broker::Kafka(kafka) => relay.brokers(kafka.bootstrap_servers()),
            Broker::JetStream(jetstream) => relay.jetstream(jetstream.clone()),
            Broker::RabbitMq(rabbitmq) => relay.rabbitmq(rabbitmq.clone()),
        }
    }

    /// A consumer reading from this broker, on either database.
    pub fn consumer<S: Send + Sync + 'static, D: ConsumerDatabase>(
        &self,
        consumer: ConsumerBuilder<S, D>,
    ) -> ConsumerBuilder<S, D> {
        match self {
            Broker::Kafka(kafka) => consumer.consumer_config(kafka.consumer_config()),
            Broker::JetStream(jetstream) => consumer.jetstream(jetstream.clone()),
            Broker::RabbitMq(rabbitmq) => consumer.rabbitmq(rabbitmq.clone()),
        }
    }
}
