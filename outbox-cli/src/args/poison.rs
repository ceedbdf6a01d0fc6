//! `outbox parked` and `outbox inbox dead`: their actions, and which rows.

use clap::{Args, Subcommand};

use super::Db;

/// Which poison rows: filters, or `--all`.
#[derive(Debug, Args)]
pub struct Selection {
    /// Only rows of this topic
    #[arg(long)]
    pub topic: Option<String>,
    /// Only rows of this event type
    #[arg(long)]
    pub event_type: Option<String>,
    /// Only this row: an event id (UUID), or an outbox row id; repeatable
    #[arg(long = "id", value_name = "ID")]
    pub ids: Vec<String>,
    /// At most this many rows, the oldest first
    #[arg(long)]
    pub limit: Option<u32>,
}

/// `list`: which rows, and how to print them.
#[derive(Debug, Args)]
pub struct List {
    #[command(flatten)]
    pub db: Db,
    #[command(flatten)]
    pub select: Selection,
    /// Print JSON (with payloads)
    #[arg(long)]
    pub json: bool,
}

/// `retry` / `drop`: which rows, and the confirmation.
#[derive(Debug, Args)]
pub struct Act {
    #[command(flatten)]
    pub db: Db,
    #[command(flatten)]
    pub select: Selection,
    /// Every row (when no filter is given)
    #[arg(long)]
    pub all: bool,
    /// Do not ask for confirmation
    #[arg(long, short = 'y')]
    pub yes: bool,
}

#[derive(Debug, Subcommand)]
pub enum ParkedAction {
    /// List parked events (the oldest first; 100 unless --limit)
    List(List),
    /// Un-park events: the relay publishes them again, attempts reset
    Retry(Act),
    /// Delete parked events for good
    Drop(Act),
}

#[derive(Debug, Subcommand)]
pub enum InboxAction {
    /// Dead inbox rows: list, retry, discard
    Dead {
        #[command(subcommand)]
        action: DeadAction,
    },
}

#[derive(Debug, Subcommand)]
pub enum DeadAction {
    /// List dead inbox rows (the oldest first; 100 unless --limit)
    List(List),
    /// Revive dead rows: the inbox processors handle them again, attempts reset
    Retry(Act),
    /// Settle dead rows without handling them: they stay as processed dedup records (a
    /// redelivery is not handled either), and retention removes them in time
    Discard(Act),
}
