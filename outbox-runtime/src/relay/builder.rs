//! [`RelayBuilder`]: a relay's settings, checked, and its transport.

use std::time::Duration;

#[cfg(feature = "kafka")]
use rdkafka::config::ClientConfig;
use sqlx::PgPool;

use super::cloudevents::CloudEvents;
use super::publish::PerKey;
use super::run::Relay;
use super::settings::Settings;
use super::transport::Transport;
use crate::admin::{HealthThresholds, Retention};
use crate::config::Backoff;
#[cfg(feature = "nats")]
use crate::error::Error;
use crate::error::Result;

/// Configures a [`Relay`]. Start with [`Relay::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RelayBuilder {
    pool: PgPool,
    #[cfg(feature = "kafka")]
    producer: ClientConfig,
    #[cfg(feature = "nats")]
    jetstream: Option<super::jetstream::JetStream>,
    settings: Settings,
}

impl Relay {
    /// A builder with the defaults; set at least the broker: [`brokers`](RelayBuilder::brokers)
    /// for Kafka, or [`jetstream`](RelayBuilder::jetstream).
    pub fn builder(pool: PgPool) -> RelayBuilder {
        RelayBuilder {
            pool,
            #[cfg(feature = "kafka")]
            producer: ClientConfig::new(),
            #[cfg(feature = "nats")]
            jetstream: None,
            settings: Settings::default(),
        }
    }
}

impl RelayBuilder {
    /// Publishes events as CloudEvents (binary content mode: `ce_*` headers), on every topic
    /// or on those [`CloudEvents::topics`] lists; see [`CloudEvents`] for the attributes.
    /// `build` refuses an empty source or topic list.
    pub fn cloud_events(mut self, cloud_events: CloudEvents) -> Self {
        self.settings.cloud_events = Some(cloud_events);
        self
    }

    /// Kafka bootstrap servers (`bootstrap.servers`).
    #[cfg(feature = "kafka")]
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.producer.set("bootstrap.servers", brokers.into());
        self
    }

    /// Producer settings (security, compression, ...). Settings given here win over the
    /// relay's defaults; `brokers` set before this call is replaced. [`build`](Self::build)
    /// refuses settings that would break the relay's promises: the producer is always
    /// idempotent (`enable.idempotence=true`, `acks=all`), fails rather than leave a gap
    /// (`enable.gapless.guarantee=true`), and never times a message out itself
    /// (`message.timeout.ms=0`: the relay bounds its waits with the publish timeout, and a
    /// message the producer timed out could let a later one of its key overtake it).
    #[cfg(feature = "kafka")]
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    pub fn producer_config(mut self, config: ClientConfig) -> Self {
        for (key, value) in config.config_map() {
            self.producer.set(key, value);
        }
        self
    }

    /// Publishes to NATS JetStream instead of Kafka: see [`JetStream`](super::JetStream) for
    /// the mapping (a topic is a subject; the event id is `Nats-Msg-Id`) and the streams.
    /// Every other setting means what it means for Kafka, but
    /// [`one_record_in_flight_per_key`](Self::one_record_in_flight_per_key): on JetStream a
    /// key's records always go one at a time (JetStream does not number a producer's messages,
    /// so a refused one would not stop the next).
    #[cfg(feature = "nats")]
    #[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
    pub fn jetstream(mut self, jetstream: super::jetstream::JetStream) -> Self {
        self.jetstream = Some(jetstream);
        self
    }

    /// Rows claimed per batch (default 500).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.settings.batch_size = batch_size;
        self
    }

    /// On a partitioned outbox, how often each instance works out the claim's floor: the
    /// `created_at` below which no row can be claimed any more, so that its claims read only
    /// the partitions from there on (default 10 s; zero: never, claims read every partition).
    /// A parked row retried, or a partition attached back, below the floor waits for the next
    /// computation.
    pub fn claim_floor_interval(mut self, interval: Duration) -> Self {
        self.settings.claim_floor_interval = interval;
        self
    }

    /// How far below the time at which no older transaction ran the claim's floor stays
    /// (default 5 minutes): a margin for the server's clock being set back, and for the moment
    /// between a transaction's start time and its virtual id (a `COMMIT AND CHAIN` that waits
    /// on a synchronous standby stretches it), under which a new row could get an older
    /// `created_at` and reach consumers after later events of its key. Zero is unsafe.
    pub fn claim_floor_margin(mut self, margin: Duration) -> Self {
        self.settings.claim_floor_margin = margin;
        self
    }

    /// How often an idle relay looks for work without a notification (default 500 ms).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval;
        self
    }

    /// The longest a batch waits for acknowledgements, and so the longest its transaction stays
    /// open (default 10 s). Records not acknowledged by then stay unpublished; the producer
    /// still delivers them if it can (a duplicate, never a reordering).
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.settings.publish_timeout = timeout;
        self
    }

    /// How long a relay that went silent (its host crashed or vanished from the network
    /// without closing its connection) keeps its shards (default 20 s). PostgreSQL ends a relay
    /// session that said nothing for this long (`idle_session_timeout`,
    /// `idle_in_transaction_session_timeout`, TCP keepalives and `tcp_user_timeout` on the
    /// server's side of the connection), which frees its shards for the others; and a relay
    /// gives up on a statement that got no answer for this long. An idle relay looks for work
    /// at least every half of it. Must exceed the publish timeout by a second at least.
    pub fn failover_timeout(mut self, timeout: Duration) -> Self {
        self.settings.failover_timeout = timeout;
        self
    }

    /// Refusals of a record before it is parked (default 5).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.settings.max_attempts = attempts;
        self
    }

    /// First wait before retrying a refused record, and after a failed batch; doubles each
    /// time up to `max` (defaults 1 s and 60 s). After a failed batch (database or broker
    /// down) the wait is drawn at random below that ("full jitter"), so that relays an outage
    /// stopped together do not retry in lockstep.
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.settings.backoff = Backoff { first, max };
        self
    }

    /// Whether a record refused for an operator's reason (its topic does not exist, the relay
    /// may not write to it, authentication failed) holds its key until that is fixed (`true`,
    /// the default: retried every `min(max_backoff, 10 s)`, never parked; `outbox status` and the
    /// `outbox_relay_held` gauge show it), or counts as an attempt like any refusal (`false`:
    /// parked after `max_attempts`, after which the key's later events overtake it).
    pub fn hold_operator_errors(mut self, hold: bool) -> Self {
        self.settings.hold_operator_errors = hold;
        self
    }

    /// Sends a key's next record only once the broker acknowledged the previous one (default
    /// `false`: all of a key's records in a batch go out together).
    ///
    /// Kafka keeps one key's records in order with several in flight, because the idempotent
    /// producer numbers them and the broker refuses what does not follow on from what it wrote:
    /// a record it refuses takes the ones behind it with it. Apache Kafka and Redpanda check;
    /// a broker that does not (librdkafka's mock cluster, some services that speak the Kafka
    /// protocol) can write a key's later record after refusing an earlier one. Turn this on for
    /// such a broker. It costs a broker round trip per record of a key in a batch: a key with
    /// many events in a batch goes out that much slower.
    pub fn one_record_in_flight_per_key(mut self, one: bool) -> Self {
        self.settings.per_key = if one {
            PerKey::OneInFlight
        } else {
            PerKey::Pipelined
        };
        self
    }

    /// When the relay's health checks warn (default: [`HealthThresholds::default`]). See
    /// [`health_interval`](Self::health_interval).
    pub fn health(mut self, thresholds: HealthThresholds) -> Self {
        self.settings.health = thresholds;
        self
    }

    /// How often the relay checks the outbox's health (default 30 s; `Duration::ZERO`: never):
    /// [`admin::health`](crate::admin::health), each warning logged when it appears (again
    /// every 10 minutes while it stands, and once when it clears) and counted in the
    /// `outbox_health_warnings{kind}` gauge, beside `outbox_table_dead_rows{table}`,
    /// `outbox_autovacuum_enabled` and `outbox_oldest_transaction_age_seconds`. One instance of
    /// the relay checks at a time, on a task of its own: a slow check never holds up
    /// publishing. At least 1 s.
    pub fn health_interval(mut self, interval: Duration) -> Self {
        self.settings.health_interval = interval;
        self
    }

    /// Runs retention beside publishing (default: none; schedule `outbox cleanup` instead): at
    /// its start and then every [`Retention::every`], one instance of this relay deletes the
    /// published outbox rows, processed inbox rows and dedup records past their retention, on a
    /// task of its own, never at the same time as another relay's run (see [`Retention`]). Logged, and counted in
    /// `outbox_retention_deleted_total{table}`. It takes two connections of the pool while it
    /// runs.
    pub fn retention(mut self, retention: Retention) -> Self {
        self.settings.retention = Some(retention);
        self
    }

    /// Validates the settings and creates the producer (or the JetStream publisher).
    pub fn build(self) -> Result<Relay> {
        let transport = self.transport()?;
        Ok(Relay::new(self.pool, Some(transport), self.settings))
    }

    /// The transport the settings name, checked with them.
    fn transport(&self) -> Result<Transport> {
        #[cfg(feature = "nats")]
        if let Some(jetstream) = &self.jetstream {
            #[cfg(feature = "kafka")]
            if self.producer.get("bootstrap.servers").is_some() {
                return Err(Error::Config(
                    "both Kafka brokers and JetStream are set: a relay publishes to one".into(),
                ));
            }
            // `check` asks for a broker's address: the client is connected already.
            self.settings.check(Some("nats"))?;
            jetstream.check().map_err(Error::Config)?;
            let publisher = jetstream.clone().publisher(
                self.settings.publish_timeout,
                self.settings.failover_timeout,
            );
            return Ok(Transport::JetStream(Box::new(publisher)));
        }
        #[cfg(feature = "kafka")]
        {
            self.settings
                .check(self.producer.get("bootstrap.servers"))?;
            let producer = super::producer::ProducerSlot::new(self.producer.clone())?;
            Ok(Transport::Kafka(producer))
        }
        #[cfg(not(feature = "kafka"))]
        Err(Error::Config(
            "no broker: call `jetstream(...)` (this build has no Kafka: feature `kafka`)".into(),
        ))
    }
}
