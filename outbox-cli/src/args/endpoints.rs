//! Where the database and the brokers are: the options of every command that connects.

use clap::Args;

use crate::parse;

/// Where the database is.
#[derive(Debug, Args)]
pub struct Db {
    /// PostgreSQL URL, e.g. postgres://user:password@host:5432/app
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    pub database_url: String,
}

/// Where Kafka is.
#[derive(Debug, Args)]
pub struct Brokers {
    /// Kafka bootstrap servers, e.g. broker1:9092,broker2:9092
    #[arg(long, env = "KAFKA_BROKERS", value_name = "HOST:PORT,...")]
    pub brokers: String,
    /// A producer setting (librdkafka's names), e.g. -X security.protocol=SASL_SSL; repeatable
    #[arg(short = 'X', long = "producer-config", value_name = "KEY=VALUE", value_parser = parse::key_value)]
    pub producer_config: Vec<(String, String)>,
}

/// Where `relay` and `replay` publish: Kafka, NATS JetStream or RabbitMQ.
#[derive(Debug, Args)]
pub struct PublishTo {
    /// Kafka bootstrap servers, e.g. broker1:9092,broker2:9092 (or --nats-url, --rabbitmq)
    #[arg(
        long,
        env = "KAFKA_BROKERS",
        value_name = "HOST:PORT,...",
        required_unless_present_any = ["nats_url", "rabbitmq"]
    )]
    pub brokers: Option<String>,
    /// A producer setting (librdkafka's names), e.g. -X security.protocol=SASL_SSL; repeatable
    #[arg(
        short = 'X',
        long = "producer-config",
        value_name = "KEY=VALUE",
        value_parser = parse::key_value,
        conflicts_with = "rabbitmq"
    )]
    pub producer_config: Vec<(String, String)>,
    /// Publish to NATS JetStream instead of Kafka, e.g. nats://127.0.0.1:4222 (a topic is a
    /// subject, which a stream must capture); KAFKA_BROKERS is then ignored
    #[arg(long, value_name = "URL", conflicts_with_all = ["producer_config", "rabbitmq"])]
    pub nats_url: Option<String>,
    #[command(flatten)]
    pub rabbitmq: RabbitMqArgs,
}

/// Where RabbitMQ is, and the topology's shape.
#[derive(Debug, Args)]
pub struct RabbitMqArgs {
    /// Publish to RabbitMQ instead of Kafka, e.g. amqp://user:password@127.0.0.1:5672/%2f (a
    /// topic is an exchange; a key's hash picks a shard queue); KAFKA_BROKERS is then ignored.
    /// TLS: amqps://...?cacertfile=/etc/ca.pem (and certfile=, keyfile= for a client
    /// certificate)
    #[arg(long, env = "RABBITMQ_URL", hide_env_values = true, value_name = "URL")]
    pub rabbitmq: Option<String>,
    /// With --rabbitmq: shards (queues per consumer group) of each topic, the same on the
    /// relay and every consumer
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub shards: u16,
}

impl RabbitMqArgs {
    /// The runtime's settings, if --rabbitmq was given.
    pub fn settings(&self) -> Option<outbox_runtime::rabbitmq::RabbitMq> {
        self.rabbitmq
            .as_ref()
            .map(|url| outbox_runtime::rabbitmq::RabbitMq::new(url.as_str()).shards(self.shards))
    }
}

/// RabbitMQ's queues to report beside the database's figures (`status`, `console`).
#[derive(Debug, Args)]
pub struct Queues {
    /// Also report RabbitMQ's queues, e.g. amqp://user:password@127.0.0.1:5672: for each --group,
    /// every shard queue's ready messages and consumers, its delay queue and the dead-letter
    /// queue (a missing queue, or a shard queue no consumer reads, is called out)
    #[arg(long = "rabbitmq", value_name = "URL", requires = "groups")]
    pub rabbitmq: Option<String>,
    /// With --rabbitmq: the shards of each topic, as the relay and consumers were given
    #[arg(long = "rabbitmq-shards", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub shards: u16,
    /// With --rabbitmq: a consumer group whose queues to report (repeatable)
    #[arg(long = "group", value_name = "GROUP")]
    pub groups: Vec<String>,
    /// With --rabbitmq: a topic whose queues to report (repeatable; default: every topic of
    /// the outbox and of the inbox)
    #[arg(long = "topic", value_name = "TOPIC")]
    pub topics: Vec<String>,
}

impl Queues {
    /// The runtime's settings, if --rabbitmq was given.
    pub fn settings(&self) -> Option<outbox_runtime::rabbitmq::RabbitMq> {
        self.rabbitmq
            .as_ref()
            .map(|url| outbox_runtime::rabbitmq::RabbitMq::new(url.as_str()).shards(self.shards))
    }
}
