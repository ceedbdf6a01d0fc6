//! The JetStream builder methods of the relay, the consumer and replay.

use std::time::Duration;

use super::settings::JetStream;
use crate::admin::Replay;
use crate::error::{Error, Result};
use crate::inbox::source::source_of;
use crate::inbox::ConsumerBuilder;
use crate::relay::{Database, RelayBuilder};

impl RelayBuilder {
    /// Publishes to NATS JetStream instead of Kafka: see [`JetStream`] for the mapping (a
    /// topic is a subject; the event id is `Nats-Msg-Id`) and the streams. Every other setting
    /// means what it means for Kafka, but
    /// [`one_record_in_flight_per_key`](Self::one_record_in_flight_per_key): without it, a
    /// key's records go out together, each on condition that the one before it is the stream's
    /// last message (`Nats-Expected-Last-Msg-Id`: JetStream does not number a producer's
    /// messages, so without that a refused one would not stop the next).
    #[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
    pub fn jetstream(mut self, jetstream: JetStream) -> Self {
        self.broker_settings().set(jetstream, ());
        self
    }
}

impl<S: Send + Sync + 'static, D: crate::inbox::ConsumerDatabase> ConsumerBuilder<S, D> {
    /// Consumes from NATS JetStream instead of Kafka: see the [module
    /// documentation](crate::inbox)'s JetStream section for the mapping (a durable pull
    /// consumer per topic, named after the group) and the promises. `build` refuses both this
    /// and `brokers`.
    #[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
    pub fn jetstream(mut self, jetstream: JetStream) -> Self {
        self.broker_settings()
            .set(jetstream, source_of::<JetStream>);
        self
    }
}

impl Replay {
    /// A replay to JetStream, with the relay's mapping (see [`JetStream`]); a topic no stream
    /// captures stops it.
    #[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
    pub fn jetstream(pool: impl Into<Database>, jetstream: JetStream) -> Result<Replay> {
        jetstream.check().map_err(Error::Config)?;
        let timeout = Duration::from_secs(30);
        Ok(Self::on(
            pool,
            super::relay::transport(&jetstream, timeout, timeout),
        ))
    }
}
