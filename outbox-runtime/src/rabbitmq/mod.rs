//! Everything that speaks RabbitMQ (feature `rabbitmq`, through amqprs): the settings a user
//! gives ([`RabbitMq`]), the wire format and the topology's names (`wire.rs`), connections
//! supervised with every wait under a timeout (`link.rs`), declaring and reading the topology
//! (`topology.rs`), the relay's confirm-mode publisher (`relay.rs`) and the consumer's shard
//! readers (`consumer.rs`). The broker-neutral core reaches it through the relay's `Transport`
//! and the consumer's `Source`; the builder methods are in `builders.rs`.
//!
//! Tested against RabbitMQ 3.10 (quorum queues, single active consumer, delivery limits). The
//! queue arguments used are those 3.8+ and 4.x document alike; on 4.x quorum queues have a
//! delivery limit of 20 by default, the value set here.

mod builders;
mod confirm;
mod consumer;
mod link;
mod previous;
mod relay;
mod report;
mod settings;
#[cfg(feature = "rabbitmq-tls")]
mod tls;
mod topology;
mod uri;
mod wire;

use std::time::Duration;

use crate::broker::BrokerSettings;
use crate::error::{Error, Result};
use crate::publish::Transport;

pub use report::{QueueKind, QueueReport};
pub use settings::RabbitMq;
pub use topology::{QueueDepth, Report};

impl BrokerSettings for RabbitMq {
    fn name(&self) -> &'static str {
        "RabbitMQ"
    }

    fn rank(&self) -> u8 {
        2
    }

    fn check(&self) -> Result<()> {
        RabbitMq::check(self).map_err(Error::Config)
    }

    fn transport(&self, timeout: Duration, _failover: Duration) -> Result<Box<dyn Transport>> {
        Ok(relay::transport(self, timeout))
    }
}
