//! The command line: `outbox`, its global options and its subcommands.

use std::time::Duration;

use clap::{Parser, Subcommand};

use super::{
    CleanupArgs, ConsoleArgs, Db, InboxAction, ParkedAction, PartitionsAction, Queues, RelayArgs,
    ReplayArgs, Thresholds, TopicsAction,
};
use crate::parse;

/// Operate the transactional outbox and inbox: migrations, status, relays, replay, retention
/// and poison events, with Kafka, NATS JetStream or RabbitMQ as the broker.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// How log lines (on stderr) look; which are shown is RUST_LOG's to say (by default
    /// `info` for `relay`, `console` and `dev-broker`, `warn` for the others)
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "OUTBOX_LOG_FORMAT")]
    pub log_format: LogFormat,
}

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One line of text per event, coloured on a terminal
    Text,
    /// One JSON object per line, for a log collector
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the outbox/inbox migrations (idempotent; safe from several processes at once)
    Migrate {
        #[command(flatten)]
        db: Db,
    },
    /// Backlog per topic: unpublished, parked, oldest unpublished age, published in the last
    /// minute; inbox backlog and dead rows; processed_event size; the tables' vacuum figures and
    /// the health warnings (autovacuum off, dead rows, the cleanup horizon held back, ...);
    /// with --rabbitmq, RabbitMQ's queues of each --group
    Status {
        #[command(flatten)]
        db: Db,
        /// Print JSON instead of tables
        #[arg(long)]
        json: bool,
        /// Exit with an error (code 1) while any health warning stands: a check for cron or a
        /// probe
        #[arg(long)]
        check: bool,
        #[command(flatten)]
        thresholds: Thresholds,
        /// Exit with an error (code 1) when an unpublished outbox row or an unprocessed inbox
        /// row is older than this, e.g. 2m: a health check for cron or a probe
        #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
        max_age: Option<Duration>,
        #[command(flatten)]
        queues: Queues,
    },
    /// Run relays as a standalone process until Ctrl-C or SIGTERM, publishing to Kafka
    /// (--brokers), NATS JetStream (--nats-url) or RabbitMQ (--rabbitmq)
    Relay(RelayArgs),
    /// Publish stored events again (with their original event_id), to rebuild a projection
    Replay(ReplayArgs),
    /// Retention: delete published outbox rows, processed inbox rows and processed_event rows
    /// older than a cut-off, in small batches (never an unpublished, parked or dead row)
    Cleanup(CleanupArgs),
    /// The broker's topics: create what the installation needs (Kafka topics; RabbitMQ's
    /// exchanges and each group's queues)
    Topics {
        #[command(subcommand)]
        action: TopicsAction,
    },
    /// The time partitions of processed_event, inbox_event or outbox_event (--table): list them,
    /// create them ahead, change their width, convert a table of an installation from before
    /// partitions
    Partitions {
        #[command(subcommand)]
        action: PartitionsAction,
    },
    /// Parked outbox events (refused by the broker too often): list, retry, drop
    Parked {
        #[command(subcommand)]
        action: ParkedAction,
    },
    /// The inbox's dead rows (handlers failed for good): list, retry
    Inbox {
        #[command(subcommand)]
        action: InboxAction,
    },
    /// Serve the operator console: web pages over the outbox and inbox (backlog and charts,
    /// relays and held keys, parked and dead rows with retry/skip/discard, find an event), until
    /// Ctrl-C or SIGTERM
    Console(ConsoleArgs),
    /// Run an in-memory Kafka (librdkafka's mock cluster) on a local port, for trying things out
    DevBroker {
        /// The local port to listen on
        #[arg(long, default_value_t = 9092)]
        port: u16,
        /// Partitions of the topics created with --topic
        #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(i32).range(1..=1000))]
        partitions: i32,
        /// A topic to create at start; repeatable (others are created on first use, with 4
        /// partitions)
        #[arg(long = "topic", value_name = "TOPIC")]
        topics: Vec<String>,
    },
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every command's options are well formed (clap checks them only when that command runs:
    /// an option that conflicts with one its command does not have panics there).
    #[test]
    fn every_command_is_well_formed() {
        super::Cli::command().debug_assert();
    }

    #[test]
    fn help_names_every_broker() {
        let mut relay = super::Cli::command();
        let help = relay
            .find_subcommand_mut("relay")
            .expect("relay")
            .render_long_help()
            .to_string();
        for option in ["--brokers", "--nats-url", "--rabbitmq"] {
            assert!(help.contains(option), "{option} in: {help}");
        }
        let top = super::Cli::command().render_help().to_string();
        assert!(top.contains("RabbitMQ"), "{top}");
    }
}
