//! `outbox cleanup`'s options.

use std::time::Duration;

use clap::Args;

use super::Db;
use crate::parse;

/// `outbox cleanup`'s options.
#[derive(Debug, Args)]
pub struct CleanupArgs {
    #[command(flatten)]
    pub db: Db,
    /// The retention, e.g. 30d, 12h, 1w
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    pub older_than: Duration,
    /// A longer retention for the dedup records (processed inbox rows, processed_event):
    /// a message delivered again after its record is gone is handled again. Default: the
    /// same as --older-than (a replay can resend anything still in the outbox)
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    pub dedup_older_than: Option<Duration>,
    /// Rows deleted per transaction
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub batch: u32,
    /// Only these tables (outbox, inbox, processed); repeatable; default all three
    #[arg(long = "table", value_name = "TABLE")]
    pub tables: Vec<outbox_runtime::admin::CleanupTable>,
    /// Count what would be deleted, delete nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Do not ask for confirmation
    #[arg(long, short = 'y')]
    pub yes: bool,
}
