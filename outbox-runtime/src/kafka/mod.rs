//! Everything that speaks Kafka (feature `kafka`, through rdkafka and librdkafka): the relay's
//! idempotent producer and how its errors are sorted, the consumer's poll loop, offsets and
//! paused retry partitions, forwarding to retry and dead-letter topics, reading a record as a
//! checked message, the topics a broker has and creating them. The broker-neutral core (the
//! relay's claims and marks, the consumer's batches) reaches it through
//! [`Transport`](crate::publish::Transport) and [`Source`](crate::inbox::source::Source).
//!
//! | file | what |
//! |---|---|
//! | `builders.rs` | the builder methods: `brokers`, `producer_config`, `consumer_config`, `Replay::new` |
//! | `producer.rs` | the relay's producer: its required settings, replaced when it fails for good |
//! | `relay.rs` | a claimed row as a record; the relay's transport; Kafka's errors sorted |
//! | `consumer.rs` | the consumer's source: its clients' settings, subscriptions, the run |
//! | `poll.rs` | batches off the consumer, offsets stored, retry partitions paused |
//! | `message.rs` | a record read as a checked message |
//! | `reading.rs` | the reading loop, both modes, and how a batch is settled on Kafka |
//! | `forward.rs` | sending a failed message to its retry or dead-letter topic |
//! | `missing_topics.rs` | watching for missing retry and dead-letter topics |
//! | `metadata.rs`, `topics.rs` | the topics a broker has; creating those an installation needs |

mod builders;
mod config;
mod consumer;
mod forward;
mod message;
pub(crate) mod metadata;
mod missing_topics;
mod poll;
mod producer;
mod reading;
mod relay;
mod topics;

use std::time::Duration;

use crate::broker::BrokerSettings;
use crate::error::{Error, Result};
use crate::publish::Transport;

use config::Config;
pub use topics::{EnsureTopics, EnsuredTopic, TopicAction, TopicRole};

impl BrokerSettings for Config {
    fn name(&self) -> &'static str {
        "Kafka brokers"
    }

    fn rank(&self) -> u8 {
        0
    }

    /// `Err(Error::Config)` if no broker was named.
    fn check(&self) -> Result<()> {
        match self.client.get("bootstrap.servers") {
            Some(brokers) if !brokers.is_empty() => Ok(()),
            _ => Err(Error::Config(
                "no Kafka brokers: call `brokers(...)` or set bootstrap.servers".into(),
            )),
        }
    }

    fn group(&self) -> Option<&str> {
        self.client.get("group.id")
    }

    // The relay bounds the producer's waits itself.
    fn transport(&self, _timeout: Duration, _failover: Duration) -> Result<Box<dyn Transport>> {
        relay::transport(self)
    }
}
