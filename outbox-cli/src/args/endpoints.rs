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

/// Where `relay` and `replay` publish: Kafka, or NATS JetStream.
#[derive(Debug, Args)]
pub struct PublishTo {
    /// Kafka bootstrap servers, e.g. broker1:9092,broker2:9092 (or --nats-url)
    #[arg(
        long,
        env = "KAFKA_BROKERS",
        value_name = "HOST:PORT,...",
        required_unless_present = "nats_url"
    )]
    pub brokers: Option<String>,
    /// A producer setting (librdkafka's names), e.g. -X security.protocol=SASL_SSL; repeatable
    #[arg(short = 'X', long = "producer-config", value_name = "KEY=VALUE", value_parser = parse::key_value)]
    pub producer_config: Vec<(String, String)>,
    /// Publish to NATS JetStream instead of Kafka, e.g. nats://127.0.0.1:4222 (a topic is a
    /// subject, which a stream must capture); KAFKA_BROKERS is then ignored
    #[arg(long, value_name = "URL", conflicts_with = "producer_config")]
    pub nats_url: Option<String>,
}
