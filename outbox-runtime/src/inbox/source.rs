//! The seam between a consumer and a broker: what the broker-neutral core asks of whichever
//! broker the consumer was built with. Each broker's folder implements [`Source`]: it reads
//! batches, hands them to the core ([`dedup::handle`](super::dedup::handle) in dedup mode,
//! [`receipt::receive_checked`](super::receipt::receive_checked) in inbox mode), and settles each
//! message the broker's way once the core's transaction committed (Kafka stores its offset,
//! JetStream acknowledges), sending a failed one where the core's verdict
//! ([`dedup::verdict`](super::dedup::verdict)) says (a retry, a dead letter).
//!
//! A trait object, not an enum of the brokers, for the relay's reason (see
//! `publish/transport.rs`): the core names no broker, the brokers' folders build on the core,
//! and a consumer makes one call through it for its whole run.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::settings::Settings;
use super::shared::Shared;
use crate::error::Result;
use crate::publish::Boxed;

/// Makes a consumer's source from its broker's settings (given as `Any`: each broker's
/// builder method stores its own maker beside its settings) and the consumer's.
pub(crate) type MakeSource = fn(&dyn std::any::Any, &Settings) -> Result<Box<dyn Source>>;

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
