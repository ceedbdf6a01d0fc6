//! [`ConsumerBuilder`]: a consumer's handlers, state and settings, checked.

use std::sync::Arc;
use std::time::Duration;

use super::consumer::Consumer;
use super::database::ConsumerDatabase;
use super::handler::Handler;
use super::route::Routes;
use super::settings::{Mode, RetryPolicy, Settings};
use super::source::MakeSource;
use super::upcast::Upcasters;
use crate::broker::Brokers;
use crate::config::Backoff;
use crate::error::{Error, Result};

/// Configures a [`Consumer`]. Start with [`Consumer::builder`].
///
/// `S` is the application state its handlers are called with ([`state`](Self::state)); `()`
/// until one is set. `D` is its database, the pool's: PostgreSQL, or MariaDB/MySQL
/// (`sqlx::MySql`, feature `mysql`).
#[must_use]
pub struct ConsumerBuilder<S = (), D: ConsumerDatabase = sqlx::Postgres> {
    pool: sqlx::Pool<D>,
    state: Arc<S>,
    routes: Routes,
    upcasters: Upcasters,
    /// Problems found while registering handlers and upcasters: `build` reports the first.
    errors: Vec<String>,
    /// The broker: set by each broker's builder methods (`brokers`, `jetstream`, ...), with
    /// how to make its source.
    brokers: Brokers<MakeSource>,
    settings: Settings,
}

impl Consumer {
    /// A builder with the defaults; set at least the brokers, the group and one handler.
    ///
    /// `pool` is a `sqlx::PgPool`, or with the feature `mysql` a `sqlx::MySqlPool` (MariaDB
    /// 10.6+, MySQL 8.0.1+): its handlers take that database's connection. On MariaDB/MySQL a
    /// consumer runs in dedup mode, on Kafka or RabbitMQ, so far (`build` says so otherwise);
    /// see [`mysql`](crate::mysql) for what differs there.
    pub fn builder<D: ConsumerDatabase>(pool: sqlx::Pool<D>) -> ConsumerBuilder<(), D> {
        ConsumerBuilder {
            pool,
            state: Arc::new(()),
            routes: Routes::default(),
            upcasters: Upcasters::default(),
            errors: Vec::new(),
            brokers: Brokers::default(),
            settings: Settings::default(),
        }
    }
}

impl<S, D: ConsumerDatabase> std::fmt::Debug for ConsumerBuilder<S, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("state", &std::any::type_name::<S>())
            .field("mode", &self.settings.mode)
            .field("topics", &self.routes.topics())
            .finish_non_exhaustive()
    }
}

impl<D: ConsumerDatabase> ConsumerBuilder<(), D> {
    /// The application state handlers are called with: an HTTP client, configuration, a
    /// cache. A handler takes it as a `state: &T` parameter (`#[inbox_handler]`), or as the
    /// `state` argument of [`Handler::handle`]. Set it before registering the handlers that
    /// take it: a handler whose state type is not `T` is a compile error, not a runtime
    /// failure. Handlers without state work with any.
    ///
    /// The consumer holds it in an [`Arc`] shared by every handler and processor; put what
    /// changes behind a lock, or hold `Arc`s inside it. One state per consumer: for several
    /// parts, make it a struct of them.
    ///
    /// ```
    /// # #[derive(serde::Serialize, serde::Deserialize, outbox_runtime::OutboxEvent)]
    /// # #[outbox(topic = "order.events", aggregate_type = "Order")]
    /// # struct OrderCreated { #[outbox(aggregate_id)] order_id: uuid::Uuid, amount: i64 }
    /// use outbox_runtime::inbox::{Consumer, HandlerError, MessageMeta};
    /// use outbox_runtime::inbox_handler;
    /// use sqlx::PgConnection;
    ///
    /// struct Payments {
    ///     provider_url: String,
    /// }
    ///
    /// #[inbox_handler]
    /// async fn charge(
    ///     event: OrderCreated,
    ///     tx: &mut PgConnection,
    ///     payments: &Payments,
    ///     meta: &MessageMeta<'_>,
    /// ) -> Result<(), HandlerError> {
    ///     tracing::info!(url = %payments.provider_url, attempt = meta.attempt(), "charging");
    ///     # let _ = (event, tx);
    ///     Ok(())
    /// }
    ///
    /// # fn build(pool: sqlx::PgPool) -> outbox_runtime::Result<()> {
    /// let consumer = Consumer::builder(pool)
    ///     .brokers("localhost:9092")
    ///     .group_id("payments")
    ///     .state(Payments { provider_url: "https://pay.example".into() })
    ///     .handler(charge)
    ///     .build()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn state<T: Send + Sync + 'static>(self, state: T) -> ConsumerBuilder<T, D> {
        ConsumerBuilder {
            pool: self.pool,
            state: Arc::new(state),
            routes: self.routes,
            upcasters: self.upcasters,
            errors: self.errors,
            brokers: self.brokers,
            settings: self.settings,
        }
    }
}

impl<S: Send + Sync + 'static, D: ConsumerDatabase> ConsumerBuilder<S, D> {
    /// The consumer group (required): Kafka's consumer group; on JetStream, the durable
    /// consumers' name. Also the first part of every handler's deduplication key.
    pub fn group_id(mut self, group: impl Into<String>) -> Self {
        self.settings.group = group.into();
        self
    }

    /// Registers a handler (see `#[inbox_handler]`). Messages are routed by their topic and
    /// `event_type` header to every handler of that event type. Handlers of one event need
    /// different [names](Handler::name); `build` refuses a name registered twice.
    pub fn handler<H: Handler<S, D>>(mut self, handler: H) -> Self {
        if let Err(e) = self.routes.add(handler, Arc::clone(&self.state)) {
            self.errors.push(e);
        }
        self
    }

    /// Registers an upcaster: a message of event `E` sent with schema version `from` that a
    /// handler of `E` does not accept ([`Handler::accepts_version`]) is made into an `E` by
    /// `upcast`, from its payload as JSON, and handed to that handler. Its error is permanent:
    /// the message goes to the dead letters with it. `from` is usually an older version; one
    /// upcaster per version (several versions: one each). The handler's
    /// [`MessageMeta::schema_version`](super::MessageMeta::schema_version) stays the version
    /// sent.
    ///
    /// `build` refuses version 0, `E`'s own version, two upcasters for one version, an
    /// upcaster for an event no handler takes, and one from a version every handler of `E`
    /// takes as it is (declared in its `versions`).
    ///
    /// ```
    /// # use outbox_runtime::inbox::{Consumer, HandlerError};
    /// # use sqlx::PgConnection;
    /// /// Version 2 split `name` into two fields.
    /// #[derive(serde::Serialize, serde::Deserialize, outbox_runtime::OutboxEvent)]
    /// #[outbox(topic = "customer.events", aggregate_type = "Customer", version = 2)]
    /// struct CustomerRenamed {
    ///     #[outbox(aggregate_id)]
    ///     customer_id: uuid::Uuid,
    ///     first_name: String,
    ///     last_name: String,
    /// }
    ///
    /// #[outbox_runtime::inbox_handler]
    /// async fn rename(event: CustomerRenamed, tx: &mut PgConnection) -> Result<(), HandlerError> {
    ///     # let _ = (event, tx);
    ///     Ok(())
    /// }
    ///
    /// # fn build(pool: sqlx::PgPool) -> outbox_runtime::Result<()> {
    /// let consumer = Consumer::builder(pool)
    ///     .brokers("localhost:9092")
    ///     .group_id("crm")
    ///     .handler(rename)
    ///     .upcast::<CustomerRenamed, _>(1, |v1: serde_json::Value| {
    ///         let name = v1["name"].as_str().ok_or("version 1 has no `name`")?;
    ///         let (first, last) = name.split_once(' ').unwrap_or((name, ""));
    ///         Ok(CustomerRenamed {
    ///             customer_id: serde_json::from_value(v1["customer_id"].clone())?,
    ///             first_name: first.into(),
    ///             last_name: last.into(),
    ///         })
    ///     })
    ///     .build()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn upcast<E, F>(mut self, from: u32, upcast: F) -> Self
    where
        E: crate::OutboxEvent + 'static,
        F: Fn(serde_json::Value) -> std::result::Result<E, crate::inbox::BoxError>
            + Send
            + Sync
            + 'static,
    {
        if let Err(e) = self.upcasters.add::<E>(from, Box::new(upcast)) {
            self.errors.push(e);
        }
        self
    }

    /// [`Mode::Dedup`] (default) or [`Mode::Inbox`].
    pub fn mode(mut self, mode: Mode) -> Self {
        self.settings.mode = mode;
        self
    }

    /// Attempts at a message whose handler fails retryably before it is dead-lettered
    /// (default 5).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.settings.max_attempts = attempts;
        self
    }

    /// Wait before a message's retry, doubling up to `max` (defaults 200 ms and 30 s). While
    /// the database or a retry/dead-letter topic is unreachable, the consumer waits a random
    /// time below the same schedule ("full jitter"), so that consumers an outage stopped
    /// together do not retry in lockstep.
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.settings.backoff = Backoff { first, max };
        self
    }

    /// Dead-letter topic of topic `t`: `t` + this suffix (default `.dlq`).
    pub fn dlq_suffix(mut self, suffix: impl Into<String>) -> Self {
        self.settings.topics.dlq_suffix = suffix.into();
        self
    }

    /// Dedup mode: [`RetryPolicy::Topic`] (default) or [`RetryPolicy::InPlace`]. Inbox mode
    /// retries in its table and ignores this.
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.settings.retry_policy = policy;
        self
    }

    /// Retry topic of topic `t`: `t` + this suffix (default `.retry`).
    pub fn retry_suffix(mut self, suffix: impl Into<String>) -> Self {
        self.settings.topics.retry_suffix = suffix.into();
        self
    }

    /// Retry topics per topic (default 1). With one, a message waiting in the retry topic
    /// holds up the retry partition's later messages until it is due (at most the longest
    /// backoff). With `n` tiers, a message's `k`-th failure sends it to
    /// `<topic><suffix>-<min(k, n)>`, so that messages in one retry topic wait about as long
    /// as each other.
    pub fn retry_tiers(mut self, tiers: u32) -> Self {
        self.settings.topics.retry_tiers = tiers;
        self
    }

    /// Inbox processor tasks this consumer runs (default 1; 0 runs none, for a deployment
    /// whose processors run elsewhere). Each holds its share of the keys' shards on a server
    /// connection of its own, taken out of the pool (see the operations guide).
    pub fn processors(mut self, processors: usize) -> Self {
        self.settings.processors = processors;
        self
    }

    /// Messages stored per inbox insert, and rows claimed per processor batch (default 500).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.settings.batch_size = batch_size;
        self
    }

    /// How often an idle inbox processor looks for rows (default 200 ms): for rows another
    /// instance received and retries coming due. Rows this instance receives wake its
    /// processors at once.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval;
        self
    }

    /// Validates the settings and creates the broker's client (on Kafka, the retry and
    /// dead-letter producer).
    pub fn build(mut self) -> Result<Consumer> {
        if let Some(e) = self.errors.first() {
            return Err(Error::Config(e.clone()));
        }
        if self.routes.is_empty() {
            return Err(Error::Config(
                "no handlers: register at least one with `handler(...)`".into(),
            ));
        }
        let (broker, make_source) = self.brokers.one("a consumer reads from one")?;
        broker.check()?;
        if self.settings.group.is_empty() {
            self.settings.group = broker.group().unwrap_or_default().to_owned();
        }
        self.settings.check()?;
        let mut routes = self.routes;
        routes
            .bind_group(self.settings.group())
            .map_err(Error::Config)?;
        routes
            .bind_upcasters(self.upcasters)
            .map_err(Error::Config)?;
        let db = D::db(self.pool);
        #[cfg(feature = "mysql")]
        if let super::database::Db::MySql(_) = &db {
            super::batch_mysql::check(&self.settings, &routes, broker.reads_under_lease())?;
        }
        let source = make_source(broker.as_any(), &self.settings)?;
        Ok(Consumer::new(db, self.settings, routes, source))
    }

    /// The broker settings, for the brokers' builder methods.
    pub(crate) fn broker_settings(&mut self) -> &mut Brokers<MakeSource> {
        &mut self.brokers
    }
}
