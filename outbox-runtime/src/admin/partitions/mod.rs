//! Time partitions: what a partitioned table holds, creating partitions ahead of time, dropping
//! those past their retention, and converting an unpartitioned table in place.
//!
//! `processed_event` (by `processed_at`), `inbox_event` (by `received_at`) and `outbox_event`
//! (by `created_at`) can be partitioned: a new installation gets a partitioned
//! `processed_event`, and an existing one keeps its plain table until
//! [`convert_to_partitions`]; `inbox_event` and `outbox_event` are partitioned only by
//! [`convert_to_partitions`] (opt-in in this version). A table's layout (partition width, how
//! far ahead partitions exist, the new partitions' storage options) is a row of
//! `outbox_partitioning`, which [`set_partitioning`] changes. The SQL functions
//! `outbox_partitions` (migration `..._013_processed_event_partitions`) and
//! `outbox_create_partitions` (`..._015_inbox_event_partitions`) do the work, so an operator
//! can call them from `psql` too.
//!
//! `layout.rs` reads a table's layout and changes its settings, `ahead.rs` creates partitions
//! ahead, `retention.rs` drops those past the window, `convert.rs` converts a plain table.

mod ahead;
mod convert;
mod layout;
mod retention;

pub use ahead::create_partitions;
#[cfg(feature = "_broker")]
pub(crate) use ahead::keep_ahead;
pub use convert::{convert_to_partitions, Conversion};
pub(crate) use layout::quote;
pub use layout::{partitions, set_partitioning, Partition, PartitionLayout};
pub(crate) use retention::{drop_partitions, kept_because, DroppedPartitions};
