//! The RabbitMQ builder methods of the relay, the consumer and replay.

use std::time::Duration;

use super::settings::RabbitMq;
use crate::admin::Replay;
use crate::error::{Error, Result};
use crate::inbox::source::source_of;
use crate::inbox::ConsumerBuilder;
use crate::relay::{Database, RelayBuilder};

impl RelayBuilder {
    /// Publishes to RabbitMQ: see [`RabbitMq`] for the mapping (a topic is an exchange, a
    /// key's hash picks a shard queue) and the topology. Every other setting means what it
    /// means for Kafka, but
    /// [`one_record_in_flight_per_key`](Self::one_record_in_flight_per_key): on RabbitMQ a
    /// key's records always go one at a time (a refused message does not stop the next).
    #[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
    pub fn rabbitmq(mut self, rabbitmq: RabbitMq) -> Self {
        self.broker_settings().set(rabbitmq, ());
        self
    }
}

impl<S: Send + Sync + 'static, D: crate::inbox::ConsumerDatabase> ConsumerBuilder<S, D> {
    /// Consumes from RabbitMQ: each of the group's shard queues has a single active consumer,
    /// so a key's messages are handled in order however many instances run (see
    /// [`RabbitMq`]). `build` refuses this beside another broker.
    #[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
    pub fn rabbitmq(mut self, rabbitmq: RabbitMq) -> Self {
        self.broker_settings().set(rabbitmq, source_of::<RabbitMq>);
        self
    }
}

impl Replay {
    /// A replay to RabbitMQ, with the relay's mapping (see [`RabbitMq`]); an unroutable topic
    /// stops it.
    #[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
    pub fn rabbitmq(pool: impl Into<Database>, rabbitmq: RabbitMq) -> Result<Replay> {
        rabbitmq.check().map_err(Error::Config)?;
        let timeout = Duration::from_secs(30);
        Ok(Self::on(pool, super::relay::transport(&rabbitmq, timeout)))
    }
}
