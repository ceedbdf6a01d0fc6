//! The command line's definitions (clap): `cli.rs` the top level and the subcommands, then the
//! options of each subcommand (or group), and those several share (`endpoints.rs`,
//! `thresholds.rs`).

mod cleanup;
mod cli;
mod console;
mod endpoints;
mod partitions;
mod poison;
mod relay;
mod replay;
mod thresholds;
mod topics;

pub use cleanup::CleanupArgs;
pub use cli::{Cli, Command, LogFormat};
pub use console::ConsoleArgs;
pub use endpoints::{Brokers, Db, PublishTo, Queues, RabbitMqArgs};
pub use partitions::PartitionsAction;
pub use poison::{Act, DeadAction, InboxAction, List, ParkedAction, Selection};
pub use relay::RelayArgs;
pub use replay::ReplayArgs;
pub use thresholds::Thresholds;
pub use topics::{TopicsAction, TopicsEnsureArgs, Transport};
