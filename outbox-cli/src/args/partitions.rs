//! `outbox partitions`' actions, and which table.

use std::time::Duration;

use clap::{Args, Subcommand};

use super::Db;
use crate::parse;

/// `outbox partitions`' actions.
#[derive(Debug, Subcommand)]
pub enum PartitionsAction {
    /// A table's partitions: bounds, estimated rows, size (or that it is not partitioned yet)
    List {
        #[command(flatten)]
        db: Db,
        #[command(flatten)]
        table: PartitionedTable,
        /// Print JSON instead of a table
        #[arg(long)]
        json: bool,
    },
    /// Create the partitions missing up to the layout's `ahead` past now (relays with
    /// retention and dedup consumers do it on their own)
    Create {
        #[command(flatten)]
        db: Db,
        #[command(flatten)]
        table: PartitionedTable,
    },
    /// Change the width of the partitions created from the last one on, and how far ahead
    /// they are kept created; then create what is missing
    Set {
        #[command(flatten)]
        db: Db,
        #[command(flatten)]
        table: PartitionedTable,
        /// Each new partition's width, a whole number of minutes up to 31 days, e.g. 1h, 1d
        #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
        width: Duration,
        /// How far past now partitions are kept created, at least 1h, e.g. 3d
        #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
        ahead: Duration,
    },
    /// Convert an installation's plain table to partitions in place, while consumers and emitters run (consumers of this version or later: stop older ones
    /// first; for outbox, stop the relays first); nothing is copied, the old table becomes the first partition
    Convert {
        #[command(flatten)]
        db: Db,
        #[command(flatten)]
        table: PartitionedTable,
        /// Convert without asking
        #[arg(long)]
        yes: bool,
    },
}

/// Which partitioned table.
#[derive(Debug, Args)]
pub struct PartitionedTable {
    /// The table: processed (processed_event, dedup mode's records), inbox (inbox_event) or outbox (outbox_event)
    #[arg(long, default_value = "processed", value_parser = parse::partitioned_table)]
    pub table: outbox_runtime::admin::CleanupTable,
}
