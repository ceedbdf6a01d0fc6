//! `outbox relay`'s options.

use std::time::Duration;

use clap::Args;

use super::{Db, PublishTo, Thresholds};
use crate::parse;

/// `outbox relay`'s options.
#[derive(Debug, Args)]
pub struct RelayArgs {
    #[command(flatten)]
    pub db: Db,
    #[command(flatten)]
    pub to: PublishTo,
    /// With --nats-url: create a stream for a topic that no stream captures (by default its
    /// events are held until one exists)
    #[arg(long, requires = "nats_url")]
    pub create_streams: bool,
    /// Relay instances in this process (they share the shards with every other relay);
    /// each holds two database connections
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub instances: u16,
    /// Rows claimed per batch
    #[arg(long, default_value_t = 500)]
    pub batch_size: usize,
    /// How often an idle relay looks for work without a notification
    #[arg(long, default_value = "500ms", value_parser = parse::duration)]
    pub poll_interval: Duration,
    /// Refusals of a record before it is parked
    #[arg(long, default_value_t = 5)]
    pub max_attempts: u32,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics, e.g. 127.0.0.1:9464
    #[arg(long, env = "OUTBOX_METRICS_ADDR", value_name = "HOST:PORT")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Also run retention, beside publishing: delete published outbox rows (and the dedup
    /// records with them) older than this, e.g. 30d; one relay process at a time does it
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    pub retention: Option<Duration>,
    /// With --retention: keep the dedup records (processed_event, processed inbox rows) this
    /// long instead; not shorter than --retention
    #[arg(long, value_parser = parse::duration, value_name = "DURATION", requires = "retention")]
    pub dedup_retention: Option<Duration>,
    /// With --retention: how often it runs
    #[arg(long, default_value = "1h", value_parser = parse::duration, value_name = "DURATION")]
    pub retention_every: Duration,
    /// How often to check the outbox's health and log its warnings (0s: never)
    #[arg(long, default_value = "30s", value_parser = parse::duration, value_name = "DURATION")]
    pub health_interval: Duration,
    #[command(flatten)]
    pub thresholds: Thresholds,
}
