//! `outbox topics`' actions and options.

use clap::{Args, Subcommand};

use super::{Brokers, Db, RabbitMqArgs};

/// `outbox topics`' actions.
#[derive(Debug, Subcommand)]
pub enum TopicsAction {
    /// Create the topics an installation needs, for brokers that do not create topics on first
    /// use: each source topic (--topic, and those of rows waiting in the outbox), and beside it
    /// its retry and dead-letter topics with its partition count; existing topics are left as
    /// they are. With --transport rabbitmq: each topic's exchange and, for each --group, its
    /// shard queues, delay queues and the dead-letter queue, with what each holds
    Ensure(TopicsEnsureArgs),
}

/// `outbox topics ensure`'s options.
#[derive(Debug, Args)]
pub struct TopicsEnsureArgs {
    #[command(flatten)]
    pub db: Db,
    /// The broker: Kafka (topics) or RabbitMQ (exchanges and queues)
    #[arg(long, value_enum, default_value = "kafka")]
    pub transport: Transport,
    /// Kafka bootstrap servers, e.g. broker1:9092,broker2:9092
    #[arg(long, env = "KAFKA_BROKERS", value_name = "HOST:PORT,...")]
    pub brokers: Option<String>,
    /// A producer setting (librdkafka's names), e.g. -X security.protocol=SASL_SSL; repeatable
    #[arg(short = 'X', long = "producer-config", value_name = "KEY=VALUE", value_parser = crate::parse::key_value)]
    pub producer_config: Vec<(String, String)>,
    #[command(flatten)]
    pub rabbitmq: RabbitMqArgs,
    /// With --transport rabbitmq: a consumer group whose queues to declare (repeatable)
    #[arg(long = "group", value_name = "GROUP")]
    pub groups: Vec<String>,
    /// A source topic to ensure (repeatable), besides those of the outbox's waiting rows
    #[arg(long = "topic", value_name = "TOPIC")]
    pub topics: Vec<String>,
    /// Partitions of a source topic that must be created (required when one must be)
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..=100_000))]
    pub partitions: Option<i32>,
    /// Replication factor of the topics created [default: the broker's]
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..=100))]
    pub replication_factor: Option<i32>,
    /// Retry topics per source topic, as the consumers' retry_tiers (0: none)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub retry_tiers: u32,
    /// The retry topics' suffix, as the consumers' retry_suffix
    #[arg(long, default_value = ".retry")]
    pub retry_suffix: String,
    /// The dead-letter topics' suffix, as the consumers' dlq_suffix
    #[arg(long, default_value = ".dlq")]
    pub dlq_suffix: String,
    /// Say what would be created, create nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

/// The brokers `topics ensure` prepares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// Kafka topics (with their retry and dead-letter topics).
    Kafka,
    /// RabbitMQ exchanges and each group's queues.
    Rabbitmq,
}

impl TopicsEnsureArgs {
    /// The Kafka brokers, as the other commands take them.
    pub fn kafka(&self) -> Brokers {
        Brokers {
            brokers: self.brokers.clone().unwrap_or_default(),
            producer_config: self.producer_config.clone(),
        }
    }
}
