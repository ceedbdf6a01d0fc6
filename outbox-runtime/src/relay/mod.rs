//! The relay: publishes the outbox to Kafka.
//!
//! ```no_run
//! use std::time::Duration;
//! use outbox_runtime::relay::Relay;
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let relay = Relay::builder(pool.clone())
//!     .brokers("127.0.0.1:9092")
//!     .batch_size(500)
//!     .poll_interval(Duration::from_millis(500))
//!     .build()?;
//! let cancel = CancellationToken::new();
//! let handle = relay.spawn(cancel.clone());
//! // ... the application runs ...
//! cancel.cancel();
//! handle.await??; // finishes the batch in flight, flushes, returns
//! # Ok(()) }
//! ```
//!
//! # How it works
//!
//! Each running instance (a [`Relay::spawn`] or [`Relay::run`]; several per process or across
//! processes) holds one PostgreSQL connection. Partition keys are spread over 64 shards
//! (`hashtext(partition_key) & 63`); through session advisory locks every instance owns a fair
//! share of the shards, and only the owner publishes a shard's rows. A batch claims the owned
//! shards' unpublished rows `ORDER BY id ... FOR UPDATE SKIP LOCKED`, sends them on the
//! idempotent producer (`acks=all`) so that no key overtakes itself, waits for the
//! acknowledgements (at most the publish timeout), then marks the acknowledged rows published
//! and commits. Ownership moves only between batches. So events of one key reach Kafka in `id`
//! order however many relays run, and a relay that dies frees its shards: at once if its
//! connection closes, within the [failover timeout](RelayBuilder::failover_timeout) if its
//! host vanished. Its unmarked rows are published again by the next owner (at-least-once).
//!
//! Each claim starts where the last one ended (a cursor that never passes a row that may still
//! commit), so a claim costs the same whatever the backlog and whatever the planner's
//! statistics say.
//!
//! A record the broker refuses for good (too large, invalid, an error nobody knows) gets an
//! attempt, its error and a retry time on its row; later records of its key wait for it; after
//! `max_attempts` it is parked (`parked_at`), kept for operators and skipped. A record refused
//! for an operator's reason (the topic does not exist, the relay is not authorized) holds its
//! key (`held_at`) until that is fixed, without counting attempts. When Kafka is down nothing is
//! marked: the relay backs off, retries and drains the backlog when it is back.

#[cfg(feature = "kafka")]
mod builder;
#[cfg(feature = "kafka")]
mod cloudevents;
#[cfg(feature = "kafka")]
mod instance;
#[cfg(feature = "kafka")]
mod producer;
#[cfg(feature = "kafka")]
pub(crate) mod publish;
#[cfg(feature = "kafka")]
mod run;
#[cfg(feature = "kafka")]
mod settings;
#[cfg_attr(not(feature = "kafka"), allow(dead_code, unused_imports))]
pub(crate) mod store;
#[cfg(feature = "kafka")]
mod wakeup;

use std::time::Duration;

use sqlx::PgPool;

use crate::error::Result;

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use builder::RelayBuilder;
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use cloudevents::CloudEvents;
#[cfg(feature = "kafka")]
pub(crate) use producer::create_producer;
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use run::{drain_without_kafka, explain_claim, Relay};

/// Backlog figures: see [`status`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStatus {
    /// Rows waiting to be published (not parked).
    pub unpublished: i64,
    /// Of those, rows the broker refused that wait for a retry (held ones included).
    pub retrying: i64,
    /// Of those, rows held back by an operator's problem: their topic does not exist, or the
    /// relay may not write to it. They wait until it is fixed.
    pub held: i64,
    /// Parked rows (refused `max_attempts` times; kept, skipped).
    pub parked: i64,
    /// Age of the oldest row waiting to be published.
    pub oldest_unpublished_age: Option<Duration>,
}

/// The relay's backlog figures, from the database alone.
pub async fn status(pool: &PgPool) -> Result<RelayStatus> {
    let (unpublished, retrying, held, parked, age): (i64, i64, i64, i64, Option<f64>) =
        sqlx::query_as(
            "SELECT count(*) FILTER (WHERE parked_at IS NULL), \
                count(*) FILTER (WHERE parked_at IS NULL AND next_attempt_at IS NOT NULL), \
                count(*) FILTER (WHERE parked_at IS NULL AND held_at IS NOT NULL), \
                count(*) FILTER (WHERE parked_at IS NOT NULL), \
                extract(epoch FROM now() - min(created_at) FILTER (WHERE parked_at IS NULL))::float8 \
         FROM outbox_event WHERE published_at IS NULL",
        )
        .fetch_one(pool)
        .await?;
    Ok(RelayStatus {
        unpublished,
        retrying,
        held,
        parked,
        oldest_unpublished_age: age.map(|s| Duration::from_secs_f64(s.max(0.0))),
    })
}
