//! The Kafka builder methods of the relay, the consumer and replay.

use rdkafka::config::ClientConfig;

use super::config::Config;
use crate::admin::Replay;
use crate::error::{Error, Result};
use crate::inbox::source::source_of;
use crate::inbox::ConsumerBuilder;
use crate::relay::{Database, RelayBuilder};

/// Sets every setting of `from` on `to`: those given win.
fn merge(to: &mut ClientConfig, from: &ClientConfig) {
    for (key, value) in from.config_map() {
        to.set(key, value);
    }
}

impl RelayBuilder {
    /// Publishes to Kafka: its bootstrap servers (`bootstrap.servers`).
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.broker_settings()
            .get_or_default::<Config>(())
            .client
            .set("bootstrap.servers", brokers.into());
        self
    }

    /// Producer settings (security, compression, ...). Settings given here win over the
    /// relay's defaults; `brokers` set before this call is replaced. [`build`](Self::build)
    /// refuses settings that would break the relay's promises: the producer is always
    /// idempotent (`enable.idempotence=true`, `acks=all`), fails rather than leave a gap
    /// (`enable.gapless.guarantee=true`), and never times a message out itself
    /// (`message.timeout.ms=0`: the relay bounds its waits with the publish timeout, and a
    /// message the producer timed out could let a later one of its key overtake it).
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    pub fn producer_config(mut self, config: ClientConfig) -> Self {
        merge(
            &mut self.broker_settings().get_or_default::<Config>(()).client,
            &config,
        );
        self
    }
}

impl<S: Send + Sync + 'static, D: crate::inbox::ConsumerDatabase> ConsumerBuilder<S, D> {
    /// Consumes from Kafka: its bootstrap servers.
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.broker_settings()
            .get_or_default::<Config>(source_of::<Config>)
            .client
            .set("bootstrap.servers", brokers.into());
        self
    }

    /// Consumer settings (security, ...); they win over the defaults. The consumer always
    /// stores offsets itself (`enable.auto.offset.store=false`): `build` refuses `true`.
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    pub fn consumer_config(mut self, config: ClientConfig) -> Self {
        merge(
            &mut self
                .broker_settings()
                .get_or_default::<Config>(source_of::<Config>)
                .client,
            &config,
        );
        self
    }

    /// Settings of the producer that sends messages to retry and dead-letter topics (by
    /// default: the consumer's `bootstrap.servers` and its `security.*`, `sasl.*` and `ssl.*`
    /// settings); they win over the defaults, except idempotence and `acks=all`, which it
    /// always uses.
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    pub fn producer_config(mut self, config: ClientConfig) -> Self {
        merge(
            &mut self
                .broker_settings()
                .get_or_default::<Config>(source_of::<Config>)
                .forwarder,
            &config,
        );
        self
    }
}

impl Replay {
    /// A replay to the Kafka cluster at `brokers`.
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    pub fn new(pool: impl Into<Database>, brokers: &str) -> Result<Replay> {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", brokers);
        Self::with_producer_config(pool, config)
    }

    /// A replay with these producer settings (`bootstrap.servers`, security, ...); they must
    /// allow an idempotent producer, like the relay's.
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    pub fn with_producer_config(pool: impl Into<Database>, config: ClientConfig) -> Result<Replay> {
        if config.get("bootstrap.servers").is_none_or(str::is_empty) {
            return Err(Error::Config("no Kafka brokers for the replay".into()));
        }
        Ok(Self::on(pool, super::relay::transport_with(config)?))
    }
}
