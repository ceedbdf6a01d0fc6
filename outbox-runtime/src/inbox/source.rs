//! The seam between a consumer and a broker: what the broker-neutral core asks of whichever
//! broker the consumer was built with, in two parts.
//!
//! - [`Source`]: the consumer's run. A broker's source reads batches its own way (Kafka's poll
//!   loop with paused retry partitions; JetStream's durable pull consumers under a lease) and
//!   hands each to the core: [`dedup::handle_batch`](super::dedup::handle_batch) in dedup mode,
//!   [`receive::receive_batch`](super::receive::receive_batch) in inbox mode.
//! - [`Reading`]: what the core needs of a broker's reading for one batch: check a message, say how often
//!   it failed before, keep the batch while the core works on it, and settle what is done once
//!   it committed (Kafka stores the offsets, JetStream acknowledges), sending each failed
//!   message where the core's verdict says (a retry later, a dead letter) first.
//!
//! So the order of a batch's transactions, the retries in place, the verdicts and what is
//! settled when are written once, in the core; a broker says only how.
//!
//! `Source` is a trait object, not an enum of the brokers, for the relay's reason (see
//! `publish/transport.rs`): the core names no broker, the brokers' folders build on the core,
//! and a consumer makes one call through it for its whole run. `Reading` is generic: the core's
//! loop is compiled for each broker, its calls per message direct.

use std::any::Any;
use std::future::Future;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::batch::{Checked, Fence};
use super::failure::Destination;
use super::settings::Settings;
use super::shared::Shared;
use crate::error::Result;
use crate::publish::Boxed;

/// A broker's settings that a consumer reads through.
pub(crate) trait Reads: 'static {
    /// The source a consumer with `settings` reads through (its clients made, what would break
    /// its promises refused).
    fn source(&self, settings: &Settings) -> Result<Box<dyn Source>>;
}

/// Makes a consumer's source from its broker's settings (given as `Any`) and the consumer's:
/// [`source_of`] for the broker's type, which its builder method stores beside its settings.
pub(crate) type MakeSource = fn(&dyn Any, &Settings) -> Result<Box<dyn Source>>;

/// A [`MakeSource`] for broker settings of type `T`.
pub(crate) fn source_of<T: Reads>(
    broker: &dyn Any,
    settings: &Settings,
) -> Result<Box<dyn Source>> {
    broker
        .downcast_ref::<T>()
        .expect("stored beside settings of its own type")
        .source(settings)
}

/// What a consumer needs of a broker.
pub(crate) trait Source: Send + Sync + 'static {
    /// Reads the consumer's topics (`shared.routes.topics()`) in its mode until `cancel`
    /// fires; then settles what the database committed and returns. Each message is settled
    /// only after its work committed, or after it was sent on (retry, dead letter).
    fn consume<'a>(
        &'a self,
        shared: &'a Arc<Shared>,
        cancel: &'a CancellationToken,
    ) -> Boxed<'a, Result<()>>;
}

/// What the core needs of a broker for one batch it read (see the module's docs).
pub(crate) trait Reading {
    /// A message as the broker delivered it.
    type Message;

    /// Checks `msg` as every handler needs it; `Err`: why it is a dead letter.
    fn check<'m>(&self, msg: &'m Self::Message) -> Checked<'m>;

    /// Attempts at `msg` that failed before this delivery (Kafka: its retry topics' count;
    /// JetStream: its deliveries before this one).
    fn failed_before(&self, msg: &Self::Message) -> u32;

    /// The lease each of the batch's transactions checks, for a broker whose group reads a
    /// topic under one; `None` for a broker whose partitions keep the order.
    fn fence(&self) -> Option<Fence<'_>> {
        None
    }

    /// Awaits `work` while `messages` stay this consumer's (JetStream tells the server it is still
    /// at them; Kafka's partitions stay assigned by themselves).
    async fn working_on<F: Future>(&self, messages: &[Self::Message], work: F) -> F::Output {
        let _ = messages;
        work.await
    }

    /// Settles `done`, messages whose work committed or failed, in order: first each failed
    /// one (`failed[i]`) goes where its verdict says (its retry, or the dead letters), then
    /// every one is settled. `false` if `cancel` fires first: what is not settled comes again.
    async fn settle(
        &self,
        done: &[Self::Message],
        failed: Vec<Option<(Destination, String)>>,
        cancel: &CancellationToken,
    ) -> bool;
}
