//! The consumer's Kafka source: its clients' settings (the consumer's and the retry and
//! dead-letter producer's), its subscriptions, and its run (subscribe, the mode's loop, commit
//! the stored offsets when it stops).

use std::sync::Arc;

use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::ClientConfig;
use tokio_util::sync::CancellationToken;

use super::config::Config;
use super::forward::{retry_topic, Forwarder};
use crate::error::{Error, Result};
use crate::inbox::settings::Settings;
use crate::inbox::shared::Shared;
use crate::inbox::source::{Reads, Source};
use crate::publish::Boxed;

/// A consumer's Kafka: the consumer's settings (the consumer is made when it runs), and the
/// retry and dead-letter producer.
pub(crate) struct Kafka {
    config: ClientConfig,
    pub(super) forwarder: Forwarder,
}

/// The source a consumer with `settings` reads from Kafka through: checks the settings that
/// would break its promises, creates the retry and dead-letter producer.
pub(crate) fn source(config: &Config, settings: &Settings) -> Result<Box<dyn Source>> {
    if config
        .client
        .get("enable.auto.offset.store")
        .is_some_and(|v| v != "false")
    {
        return Err(Error::Config(
            "enable.auto.offset.store must stay false: offsets are stored only after the \
             database committed"
                .into(),
        ));
    }
    let forwarder = Forwarder::new(forwarder_config(config), settings)?;
    Ok(Box::new(Kafka {
        config: consumer_config(config, settings.group()),
        forwarder,
    }))
}

impl Source for Kafka {
    fn consume<'a>(
        &'a self,
        shared: &'a Arc<Shared>,
        cancel: &'a CancellationToken,
    ) -> Boxed<'a, Result<()>> {
        Box::pin(self.run(shared, cancel))
    }
}

impl Kafka {
    /// Consumes until `cancel` fires, then commits what was stored.
    async fn run(&self, shared: &Arc<Shared>, cancel: &CancellationToken) -> Result<()> {
        let settings = &shared.settings;
        let consumer: StreamConsumer =
            self.config.create().map_err(|source| Error::KafkaClient {
                client: "consumer",
                source,
            })?;
        let topics = subscriptions(settings, shared.routes.topics());
        let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;
        // Say now, not at the first failure, if a retry or dead-letter topic is missing.
        let checking = tokio::spawn(super::missing_topics::watch(
            Arc::clone(shared),
            self.forwarder.producer().clone(),
            cancel.child_token(),
        ));
        let result = super::reading::consume(shared, &self.forwarder, &consumer, cancel).await;
        // Commit what was stored (the database has committed all of it).
        if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
            tracing::debug!(error = %crate::error_chain(&e), "no offsets to commit on shutdown");
        }
        checking.abort();
        result
    }
}

/// The Kafka consumer's settings: the given ones, the group, offsets stored by the consumer
/// itself, and from the earliest offset unless told otherwise.
fn consumer_config(config: &Config, group: &str) -> ClientConfig {
    let mut config = config.client.clone();
    config.set("group.id", group);
    config.set("enable.auto.offset.store", "false");
    if config.get("auto.offset.reset").is_none() {
        config.set("auto.offset.reset", "earliest");
    }
    config
}

/// The retry and dead-letter producer's settings: the consumer's `bootstrap.servers` and its
/// `security.*`, `sasl.*` and `ssl.*` settings, then the defaults, then the given ones, and
/// always idempotence and `acks=all`.
fn forwarder_config(config: &Config) -> ClientConfig {
    let mut producer_config = ClientConfig::new();
    for (key, value) in config.client.config_map() {
        if key == "bootstrap.servers"
            || key.starts_with("security.")
            || key.starts_with("sasl.")
            || key.starts_with("ssl.")
        {
            producer_config.set(key, value);
        }
    }
    // Each send is awaited until acknowledged: a bounded message timeout lets the consumer
    // see (and say) that a topic is missing or refuses, then try again.
    // The consumer waits for each send: no lingering for a batch to fill (a batch's sends
    // are queued together anyway).
    producer_config
        .set("message.timeout.ms", "30000")
        .set("topic.metadata.propagation.max.ms", "5000")
        .set("linger.ms", "0");
    for (key, value) in config.forwarder.config_map() {
        producer_config.set(key, value);
    }
    producer_config
        .set("enable.idempotence", "true")
        .set("acks", "all");
    producer_config
}

/// The topics a consumer subscribes to: its handlers' (`handled`), and in dedup mode with
/// retry topics, their retry topics.
fn subscriptions(settings: &Settings, handled: Vec<String>) -> Vec<String> {
    let mut topics = handled;
    if settings.retries_through_topics() {
        let tiers = settings.topics.retry_tiers;
        let retry: Vec<String> = topics
            .iter()
            .flat_map(|t| (1..=tiers).map(move |tier| retry_topic(&settings.topics, t, tier)))
            .collect();
        topics.extend(retry);
    }
    topics
}

impl Reads for Config {
    fn source(&self, settings: &Settings) -> Result<Box<dyn Source>> {
        source(self, settings)
    }
}
