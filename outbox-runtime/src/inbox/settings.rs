//! A consumer's settings: what its builder sets and checks, kept whole by the running
//! consumer, with what follows from them (the Kafka clients' settings, the retry and
//! dead-letter topics' names, the backoff schedules).

use std::time::Duration;

#[cfg(feature = "kafka")]
use rdkafka::ClientConfig;

use crate::config::Backoff;
use crate::error::{Error, Result};

/// How a consumer hands messages to its handlers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Mode {
    /// Handle each message at once, deduplicated through `processed_event`.
    #[default]
    Dedup,
    /// Store messages in `inbox_event` first; processor tasks handle them at their own pace.
    Inbox,
}

/// What a dedup-mode consumer does with a message whose handler failed retryably.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RetryPolicy {
    /// Send it to its retry topic (`<topic>.retry`), store its offset and go on: its
    /// partition flows on, and the consumer (which also reads the retry topic) tries it again
    /// once its backoff has passed; after `max_attempts`, its dead-letter topic. A retried
    /// message is handled after its key's later messages. The style guide's choice for
    /// ordinary consumers (R-DIST-OBX-2).
    #[default]
    Topic,
    /// Retry it where it is, with backoff, before anything after it in the consumer's batch:
    /// strict per-key order, but a failing message holds up every partition of the consumer
    /// meanwhile. For flows whose handlers need one key's events in order.
    InPlace,
}

/// A consumer's settings (see [`ConsumerBuilder`](super::ConsumerBuilder) for each), with
/// its defaults.
pub(crate) struct Settings {
    /// The consumer group (`group_id`).
    pub(crate) group: String,
    /// The Kafka consumer's settings, as given (`brokers`, `consumer_config`).
    #[cfg(feature = "kafka")]
    pub(crate) config: ClientConfig,
    /// The retry and dead-letter producer's settings, as given (`producer_config`).
    #[cfg(feature = "kafka")]
    pub(crate) producer_config: ClientConfig,
    /// JetStream instead of Kafka (`jetstream`).
    #[cfg(feature = "nats")]
    pub(crate) jetstream: Option<crate::relay::JetStream>,
    pub(crate) mode: Mode,
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
    pub(crate) retry_policy: RetryPolicy,
    pub(crate) topics: Topics,
    pub(crate) processors: usize,
    pub(crate) batch_size: usize,
    pub(crate) poll_interval: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            group: String::new(),
            #[cfg(feature = "kafka")]
            config: ClientConfig::new(),
            #[cfg(feature = "kafka")]
            producer_config: ClientConfig::new(),
            #[cfg(feature = "nats")]
            jetstream: None,
            mode: Mode::Dedup,
            max_attempts: 5,
            backoff: Backoff {
                first: Duration::from_millis(200),
                max: Duration::from_secs(30),
            },
            retry_policy: RetryPolicy::Topic,
            topics: Topics {
                dlq_suffix: ".dlq".into(),
                retry_suffix: ".retry".into(),
                retry_tiers: 1,
            },
            processors: 1,
            batch_size: 500,
            poll_interval: Duration::from_millis(200),
        }
    }
}

impl Settings {
    /// `Err(Error::Config)` names the first setting that cannot work.
    pub(crate) fn check(&self) -> Result<()> {
        let fail = |msg: String| Err(Error::Config(msg));
        #[cfg(feature = "kafka")]
        let brokers = self.config.get("bootstrap.servers");
        #[cfg(not(feature = "kafka"))]
        let brokers = None;
        #[cfg(feature = "nats")]
        let brokers = match &self.jetstream {
            Some(_) if brokers.is_some() => {
                return fail(
                    "both Kafka brokers and JetStream are set: a consumer reads from one".into(),
                )
            }
            // The client is connected already.
            Some(jetstream) => {
                jetstream.check().map_err(Error::Config)?;
                Some("nats")
            }
            None if cfg!(not(feature = "kafka")) => {
                return fail(
                    "no broker: call `jetstream(...)` (this build has no Kafka: feature `kafka`)"
                        .into(),
                )
            }
            None => brokers,
        };
        crate::config::check_common(
            brokers,
            self.batch_size,
            self.poll_interval,
            self.max_attempts,
            self.backoff,
        )?;
        if self.group().is_empty() {
            return fail("no consumer group: call `group_id(...)`".into());
        }
        #[cfg(feature = "kafka")]
        if self
            .config
            .get("enable.auto.offset.store")
            .is_some_and(|v| v != "false")
        {
            return fail(
                "enable.auto.offset.store must stay false: offsets are stored only after the \
                 database committed"
                    .into(),
            );
        }
        let topics = &self.topics;
        if topics.dlq_suffix.is_empty() || topics.retry_suffix.is_empty() {
            return fail("the dead-letter and retry suffixes must not be empty".into());
        }
        if topics.dlq_suffix == topics.retry_suffix {
            return fail("the dead-letter and retry suffixes must differ".into());
        }
        if topics.retry_tiers == 0 || topics.retry_tiers > 100 {
            return fail(format!(
                "retry_tiers must be between 1 and 100, not {}",
                topics.retry_tiers
            ));
        }
        Ok(())
    }

    /// The consumer group: `group_id`'s, or the `group.id` of the Kafka settings given.
    pub(crate) fn group(&self) -> &str {
        #[cfg(feature = "kafka")]
        if self.group.is_empty() {
            return self.config.get("group.id").unwrap_or_default();
        }
        &self.group
    }

    /// The Kafka consumer's settings: the given ones, the group, offsets stored by the consumer
    /// itself, and from the earliest offset unless told otherwise.
    #[cfg(feature = "kafka")]
    pub(crate) fn consumer_config(&self) -> ClientConfig {
        let mut config = self.config.clone();
        config.set("group.id", self.group());
        config.set("enable.auto.offset.store", "false");
        if config.get("auto.offset.reset").is_none() {
            config.set("auto.offset.reset", "earliest");
        }
        config
    }

    /// The retry and dead-letter producer's settings: the consumer's `bootstrap.servers` and
    /// its `security.*`, `sasl.*` and `ssl.*` settings, then the defaults, then the given
    /// ones, and always idempotence and `acks=all`.
    #[cfg(feature = "kafka")]
    pub(crate) fn forwarder_config(&self) -> ClientConfig {
        let mut producer_config = ClientConfig::new();
        for (key, value) in self.config.config_map() {
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
        for (key, value) in self.producer_config.config_map() {
            producer_config.set(key, value);
        }
        producer_config
            .set("enable.idempotence", "true")
            .set("acks", "all");
        producer_config
    }

    /// The topics a consumer subscribes to: its handlers' (`handled`), and in dedup mode with
    /// retry topics, their retry topics.
    #[cfg(feature = "kafka")]
    pub(crate) fn subscriptions(&self, handled: Vec<String>) -> Vec<String> {
        let mut topics = handled;
        if self.mode == Mode::Dedup && self.retry_policy == RetryPolicy::Topic {
            let retry: Vec<String> = topics
                .iter()
                .flat_map(|t| {
                    (1..=self.topics.retry_tiers).map(move |tier| self.topics.retry(t, tier))
                })
                .collect();
            topics.extend(retry);
        }
        topics
    }

    /// The topics a consumer may send messages of `handled` topics to, each with its source
    /// topic and role (`retry` or `dead_letter`): every source's dead-letter topic, and in
    /// dedup mode with retry topics, its retry topics.
    #[cfg(feature = "kafka")]
    pub(crate) fn forward_topics(&self, handled: &[String]) -> Vec<(String, String, &'static str)> {
        let retries = self.mode == Mode::Dedup && self.retry_policy == RetryPolicy::Topic;
        handled
            .iter()
            .flat_map(|source| {
                let retry = (1..=self.topics.retry_tiers)
                    .filter(move |_| retries)
                    .map(move |tier| (self.topics.retry(source, tier), source.clone(), "retry"));
                retry.chain(std::iter::once((
                    self.topics.dead_letter(source),
                    source.clone(),
                    "dead_letter",
                )))
            })
            .collect()
    }

    /// The wait before a message's next attempt after its `attempt`-th failure.
    pub(crate) fn backoff(&self, attempt: u32) -> Duration {
        self.backoff.delay(attempt)
    }

    /// The wait after the `failures`-th failure in a row of the database or the broker:
    /// jittered, so that the consumers an outage stopped together do not retry in lockstep.
    pub(crate) fn outage_backoff(&self, failures: u32) -> Duration {
        self.backoff.jittered(failures)
    }
}

/// The names of a topic's retry and dead-letter topics.
#[derive(Debug, Clone)]
pub(crate) struct Topics {
    pub(crate) dlq_suffix: String,
    pub(crate) retry_suffix: String,
    pub(crate) retry_tiers: u32,
}

impl Topics {
    /// The retry topic of source topic `source` for a message that failed `attempts` times.
    #[cfg(feature = "kafka")]
    pub(crate) fn retry(&self, source: &str, attempts: u32) -> String {
        if self.retry_tiers == 1 {
            format!("{source}{}", self.retry_suffix)
        } else {
            let tier = attempts.clamp(1, self.retry_tiers);
            format!("{source}{}-{tier}", self.retry_suffix)
        }
    }

    /// The dead-letter topic of source topic `source`.
    pub(crate) fn dead_letter(&self, source: &str) -> String {
        format!("{source}{}", self.dlq_suffix)
    }
}
