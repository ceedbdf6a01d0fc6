//! `outbox topics`' actions and options.

use clap::{Args, Subcommand};

use super::{Brokers, Db};

/// `outbox topics`' actions.
#[derive(Debug, Subcommand)]
pub enum TopicsAction {
    /// Create the topics an installation needs, for brokers that do not create topics on first
    /// use: each source topic (--topic, and those of rows waiting in the outbox), and beside it
    /// its retry and dead-letter topics with its partition count; existing topics are left as
    /// they are
    Ensure(TopicsEnsureArgs),
}

/// `outbox topics ensure`'s options.
#[derive(Debug, Args)]
pub struct TopicsEnsureArgs {
    #[command(flatten)]
    pub db: Db,
    #[command(flatten)]
    pub brokers: Brokers,
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
