//! [`Config`]: Kafka's settings as the builders collect them.

use rdkafka::ClientConfig;

/// Kafka's settings, as the builders collect them.
#[derive(Debug, Clone, Default)]
pub(crate) struct Config {
    /// The relay's producer's settings (`brokers`, `producer_config`), or a consumer's
    /// (`brokers`, `consumer_config`).
    pub(crate) client: ClientConfig,
    /// A consumer's retry and dead-letter producer's (`producer_config`).
    pub(crate) forwarder: ClientConfig,
}
