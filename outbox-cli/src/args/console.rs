//! `outbox console`'s options.

use std::time::Duration;

use clap::Args;

use super::{Db, Queues, Thresholds};
use crate::parse;

/// `outbox console`'s arguments.
#[derive(Debug, Args)]
pub struct ConsoleArgs {
    #[command(flatten)]
    pub db: Db,
    /// The address to serve on; anything but a loopback address lets other machines read the
    /// pages (payloads included)
    #[arg(long, default_value = "127.0.0.1:8080", value_name = "HOST:PORT")]
    pub listen: std::net::SocketAddr,
    /// Allow actions (retry, skip, discard) to whoever signs in with --token
    #[arg(long)]
    pub allow_actions: bool,
    /// The token that actions need (at least 16 characters); only with --allow-actions
    #[arg(
        long,
        env = "OUTBOX_CONSOLE_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub token: Option<String>,
    /// How often the charts' figures are sampled
    #[arg(long, default_value = "10s", value_parser = parse::duration, value_name = "DURATION")]
    pub sample_interval: Duration,
    #[command(flatten)]
    pub thresholds: Thresholds,
    #[command(flatten)]
    pub queues: Queues,
}
