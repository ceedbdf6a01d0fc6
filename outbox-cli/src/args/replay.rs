//! `outbox replay`'s options.

use clap::Args;

use super::{Db, PublishTo};
use crate::parse;

/// `outbox replay`'s options.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub db: Db,
    #[command(flatten)]
    pub to: PublishTo,
    /// The topic whose published events to replay
    #[arg(long)]
    pub topic: String,
    /// Only events created at or after this time (RFC 3339, a date, or a duration ago: 2h)
    #[arg(long, value_parser = parse::time, value_name = "TIME")]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only events created before this time
    #[arg(long, value_parser = parse::time, value_name = "TIME")]
    pub until: Option<chrono::DateTime<chrono::Utc>>,
    /// Only events of this aggregate type
    #[arg(long)]
    pub aggregate_type: Option<String>,
    /// Only events of this event type
    #[arg(long)]
    pub event_type: Option<String>,
    /// Publish to this topic instead of the original one
    #[arg(long, value_name = "TOPIC")]
    pub to_topic: Option<String>,
    /// Count what would be replayed, publish nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Records sent before waiting for their acknowledgements
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..=50_000))]
    pub batch_size: u32,
}
