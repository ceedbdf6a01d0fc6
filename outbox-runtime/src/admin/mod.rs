//! Operations on the outbox and inbox tables, for operators and their tools (the `outbox` CLI
//! is a thin layer over this module): backlog figures per topic ([`status`]), retention
//! ([`Cleanup`]), the broker's topics ([`EnsureTopics`]), poison events (parked outbox rows and dead inbox rows: [`list_parked`],
//! [`retry_parked`], [`drop_parked`], [`list_dead`], [`retry_dead`], [`discard_dead`]; a page of
//! them with each payload summarized, [`list_parked_summaries`] and [`list_dead_summaries`]),
//! replay ([`Replay`]), where things are ([`relay_instances`], [`held_keys`], [`find_event`],
//! an event's payload as the relay sends it, [`payload_text`]).
//!
//! Everything here works on the database alone, except [`replay`](crate::admin::Replay), which
//! publishes (feature `kafka` or `nats`). Every function is safe to run while relays and consumers run:
//! retention deletes in small batches and skips rows another transaction holds, and the poison
//! tools only touch parked or dead rows, which no relay or processor works on.
//!
//! What each operation is for, and when to run it: the
//! [operations guide](https://github.com/outbox-rs/outbox/blob/main/docs/operations.md); the
//! CLI's commands: [`outbox-cli`'s README](https://github.com/outbox-rs/outbox/blob/main/outbox-cli/README.md).

mod cleanup;
mod delete;
pub(crate) mod health;
mod inspect;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "mysql")]
pub(crate) mod mysql_cleanup;
pub(crate) mod partitions;
mod poison;
#[cfg(feature = "mysql")]
pub(crate) mod poison_mysql;
#[cfg(feature = "_broker")]
mod replay;
pub(crate) mod status;

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use crate::kafka::{EnsureTopics, EnsuredTopic, TopicAction, TopicRole};
pub use cleanup::{Cleanup, CleanupTable, Retention, RetentionReport};
/// A hook of this project's own tests and benchmarks (feature `testing`); not API.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub use health::health_estimated;
pub use health::{
    health, Health, HealthThresholds, TableHealth, Warning, WarningKind,
    VACUUM_OVERDUE_MIN_DEAD_ROWS,
};
pub use inspect::{
    find_event, held_keys, payload_text, relay_instances, DedupRow, EventRef, EventTrace, HeldKey,
    InboxRow, OutboxRow, PayloadOf, RelayInstance,
};
pub use partitions::{
    convert_to_partitions, create_partitions, partitions, set_partitioning, Conversion, Partition,
    PartitionLayout,
};
pub use poison::{
    count_dead, count_parked, discard_dead, drop_parked, list_dead, list_dead_summaries,
    list_parked, list_parked_summaries, retry_dead, retry_dead_by, retry_parked, retry_parked_by,
    DeadInboxEvent, DeadInboxEventSummary, ParkedEvent, ParkedEventSummary, PayloadSummary,
    PoisonFilter, PAYLOAD_PREVIEW_CHARS, PAYLOAD_SUMMARY_MAX_STORED,
};
#[cfg(feature = "_broker")]
pub use replay::{Replay, ReplayCounts, ReplayFilter};
pub use status::{
    status, ConsumerLease, InboxStatus, InboxTopicStatus, RelayStatus, Status, TopicStatus,
};
