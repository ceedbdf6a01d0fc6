//! [`RelayBuilder`]: a relay's settings, checked, and its transport.

use std::time::Duration;

use super::run::Relay;
use super::settings::Settings;
use crate::admin::{HealthThresholds, Retention};
use crate::broker::Brokers;
use crate::config::Backoff;
use crate::error::Result;
use crate::publish::{CloudEvents, PerKey};
use crate::store::database::Database;

/// Configures a [`Relay`]. Start with [`Relay::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RelayBuilder {
    pool: Database,
    /// The broker: set by each broker's builder methods (`brokers`, `jetstream`, ...).
    brokers: Brokers,
    settings: Settings,
}

impl Relay {
    /// A builder with the defaults; set at least the broker: `brokers` for Kafka (feature
    /// `kafka`), `jetstream` (feature `nats`) or `rabbitmq` (feature `rabbitmq`). The pool is
    /// a `PgPool`, or a `MySqlPool` (feature `mysql`: see [`crate::mysql`] for what differs).
    pub fn builder(pool: impl Into<Database>) -> RelayBuilder {
        RelayBuilder {
            pool: pool.into(),
            brokers: Brokers::default(),
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
    /// [`admin::health`](crate::admin::health) (on MariaDB/MySQL, `mysql::health`, its
    /// `processed_event` rows not counted), each warning logged when it appears (again
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
    /// runs. On MariaDB/MySQL it deletes published outbox rows and dedup records, in batches
    /// (no partitions there; `Retention::run_once_mysql`).
    pub fn retention(mut self, retention: Retention) -> Self {
        self.settings.retention = Some(retention);
        self
    }

    /// Validates the settings and creates the broker's client (Kafka's producer, the
    /// JetStream publisher).
    pub fn build(self) -> Result<Relay> {
        let (broker, ()) = self.brokers.one("a relay publishes to one")?;
        broker.check()?;
        self.settings.check()?;
        let transport = broker.transport(
            self.settings.publish_timeout,
            self.settings.failover_timeout,
        )?;
        Ok(Relay::new(self.pool, Some(transport), self.settings))
    }

    /// The broker settings, for the brokers' builder methods.
    pub(crate) fn broker_settings(&mut self) -> &mut Brokers {
        &mut self.brokers
    }
}
