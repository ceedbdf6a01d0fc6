//! Everything that speaks NATS JetStream (feature `nats`, through async-nats): the settings a
//! user gives ([`JetStream`]), the wire format (`wire.rs`: subjects, header names, encoding),
//! streams (`streams.rs`: looking them up, creating them, naming them), the relay's publisher
//! (`relay.rs`) and the consumer's durable pull consumers (`consumer.rs`). The broker-neutral
//! core reaches it through the relay's `Transport` and the consumer's `Source`; the
//! builder methods are in `builders.rs`.

mod builders;
mod consumer;
mod received;
mod relay;
mod settings;
mod streams;
mod wire;

use std::time::Duration;

use crate::broker::BrokerSettings;
use crate::error::{Error, Result};
use crate::publish::Transport;

pub use settings::JetStream;

impl BrokerSettings for JetStream {
    fn name(&self) -> &'static str {
        "JetStream"
    }

    fn reads_under_lease(&self) -> bool {
        true
    }

    fn rank(&self) -> u8 {
        1
    }

    fn check(&self) -> Result<()> {
        JetStream::check(self).map_err(Error::Config)
    }

    fn transport(&self, timeout: Duration, failover: Duration) -> Result<Box<dyn Transport>> {
        Ok(relay::transport(self, timeout, failover))
    }
}
