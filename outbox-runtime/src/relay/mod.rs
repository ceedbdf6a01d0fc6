//! The relay: publishes the outbox to Kafka, to NATS JetStream ([`JetStream`], feature `nats`)
//! or to RabbitMQ ([`RabbitMq`], feature `rabbitmq`); below.
//!
//! ```no_run
//! use std::time::Duration;
//! use outbox_runtime::relay::Relay;
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let relay = Relay::builder(pool.clone())
//!     .brokers("127.0.0.1:9092")              // or .producer_config(rdkafka::ClientConfig)
//!     .batch_size(500)
//!     .poll_interval(Duration::from_millis(500))
//!     .build()?;                              // refuses enable.idempotence=false or acks!=all
//! let cancel = CancellationToken::new();
//! let handle = relay.spawn(cancel.clone());   // a tokio task; or `relay.run(cancel).await`
//! // ... the application runs ...
//! cancel.cancel();
//! handle.await??; // finishes the batch in flight, returns
//! # Ok(()) }
//! ```
//!
//! Run as many instances as you like, in one process ([`Relay::spawn`] again) or in many (the
//! `outbox relay` command of `outbox-cli` is one such process): they share the work through
//! PostgreSQL alone, with no other coordination. Each instance holds two connections of the pool
//! (its work and its `LISTEN`): size the pool for them.
//!
//! # How it works
//!
//! Each running instance (a [`Relay::spawn`] or [`Relay::run`]) holds one PostgreSQL connection
//! for its work. Partition keys are spread over 64 shards (`hashtext(partition_key) & 63`);
//! through session advisory locks (keyed by the outbox table, so installations in two schemas of
//! one database stay apart) every instance owns a fair share of the shards, and only the owner
//! publishes a shard's rows. A batch claims the owned shards' unpublished rows
//! `ORDER BY id ... FOR UPDATE SKIP LOCKED`, sends them on the idempotent producer (`acks=all`),
//! waits for the acknowledgements (at most the [publish timeout](RelayBuilder::publish_timeout)),
//! then marks the acknowledged rows published and commits. Ownership moves only between batches.
//! So events of one key reach Kafka in `id` order however many relays run, and a relay that dies
//! frees its shards: at once if its connection closes, within the
//! [failover timeout](RelayBuilder::failover_timeout) if its host vanished (no FIN, no RST).
//! Its unmarked rows are published again by the next owner (at-least-once).
//!
//! **Per-key order across failures.** The producer is idempotent with
//! `enable.gapless.guarantee` and no producer-side message timeout (the batch bounds its own
//! wait), so a refused record is never overtaken by a later one of its key; a key's record for
//! another topic waits until its earlier records are acknowledged; a later record is marked
//! published only if every earlier one of its key was. This relies on the broker checking
//! idempotent sequence numbers, as Apache Kafka and Redpanda do; for a broker that does not,
//! [`one_record_in_flight_per_key(true)`](RelayBuilder::one_record_in_flight_per_key) sends a
//! key's records one at a time. A producer that fails for good (a fatal idempotence error) is
//! replaced, and the relay goes on.
//!
//! **A claim costs what its batch costs**, whatever the backlog and whatever the planner's
//! statistics say (a never-analyzed table after a burst, statistics taken while the table was
//! empty): each claim starts where the last one ended (a cursor that never steps past a row that
//! may still commit), and the relay's session can only walk indexes in order.
//!
//! **Latency.** Emitters send `NOTIFY` while a relay waits for work, so a committed event is
//! published within milliseconds; the relay also polls every
//! [`poll_interval`](RelayBuilder::poll_interval). Under load the relays are busy and emitters
//! skip the `NOTIFY`, which PostgreSQL would otherwise serialize.
//!
//! **What it needs from the database**: rows written through `outbox_emit` (what every emit
//! function calls), and the `outbox_event.id` sequence at `CACHE 1` (the default; checked). The
//! relay never deletes a row: retention is a separate job ([`admin::Cleanup`](crate::admin::Cleanup),
//! `outbox cleanup`).
//!
//! # Settings
//!
//! Set on [`RelayBuilder`]; [`build`](RelayBuilder::build) checks them and says which one cannot
//! work.
//!
//! | setting | default | |
//! |---|---|---|
//! | [`brokers`](RelayBuilder::brokers) | required | or `bootstrap.servers` in `producer_config` |
//! | [`producer_config`](RelayBuilder::producer_config) | | librdkafka's settings (security, compression); `enable.idempotence`, `acks=all`, `enable.gapless.guarantee` and `message.timeout.ms=0` are always set (settings that say otherwise are refused); `linger.ms=0` and `topic.metadata.propagation.max.ms=1000` unless set |
//! | [`batch_size`](RelayBuilder::batch_size) | 500 | rows claimed per batch |
//! | [`poll_interval`](RelayBuilder::poll_interval) | 500 ms | how often an idle relay looks for work without a notification |
//! | [`publish_timeout`](RelayBuilder::publish_timeout) | 10 s | the longest a batch waits for acknowledgements and holds its transaction |
//! | [`failover_timeout`](RelayBuilder::failover_timeout) | 20 s | how long a silent relay keeps its shards; above the publish timeout |
//! | [`max_attempts`](RelayBuilder::max_attempts) | 5 | refusals of a record before it is parked |
//! | [`retry_backoff`](RelayBuilder::retry_backoff) | 1 s, doubling up to 60 s | between attempts at a refused record, and after a failed batch (jittered) |
//! | [`hold_operator_errors`](RelayBuilder::hold_operator_errors) | `true` | whether an operator's problem holds its key instead of counting attempts |
//! | [`one_record_in_flight_per_key`](RelayBuilder::one_record_in_flight_per_key) | `false` | for brokers that do not check idempotent sequence numbers |
//! | [`cloud_events`](RelayBuilder::cloud_events) | off | CloudEvents headers (below) |
//!
//! For a secured cluster, see the operations guide's
//! [TLS](https://github.com/outbox-rs/outbox/blob/main/docs/operations.md#tls) section.
//!
//! # The records
//!
//! Key: the partition key. Value: the JSON payload. Timestamp: the row's `created_at` (in a
//! replay, the replay's time). Headers: `event_id`, `event_type`, `aggregate_type`,
//! `aggregate_id`, `content-type` (`application/json`) and `outbox_id`; then the CloudEvents
//! attributes, if configured (below); then the row's own headers, in name order: the
//! application's from [`Uow::emit_with`](crate::Uow::emit_with), the trace context of
//! [`crate::trace`], and [`SCHEMA_VERSION_HEADER`](crate::SCHEMA_VERSION_HEADER) for an event of
//! version 2 or later.
//!
//! # Refused records: retried, held, parked
//!
//! A record the broker refuses (too large, invalid, an error nobody classified) gets an attempt,
//! its error and a retry time on its row (`attempts`, `last_error`, `next_attempt_at`); later
//! records of its key wait for it; after `max_attempts` it is parked (`parked_at`, its retry
//! time cleared), kept for operators and skipped, and the key's later events go on. However
//! many rows are parked, a batch does not read them: it reads only the rows waiting for a retry. A record refused for an operator's
//! reason (its topic does not exist, the relay may not write to it, authentication fails) *holds*
//! its key instead (`held_at`): retried every `min(max backoff, 10 s)`, not counted as an attempt,
//! never parked, until that is fixed; `hold_operator_errors(false)` treats such refusals like any
//! other. When Kafka is down nothing is marked: the relay backs off, retries, and drains the
//! backlog when it is back. What to do about parked and held rows: the
//! [operations guide](https://github.com/outbox-rs/outbox/blob/main/docs/operations.md#poison-events).
//!
//! # Draining, status, health, metrics
//!
//! [`Relay::publish_pending`] publishes the backlog once and returns (tests, scripts).
//! [`Relay::status`] gives the backlog figures from the database alone (per topic:
//! [`admin::status`](crate::admin::status)):
//! unpublished, retrying, held, parked, and the age of the oldest waiting row. A running relay
//! records metrics through the [`metrics`](https://docs.rs/metrics) facade (their names and what
//! to alert on: the
//! [operations guide](https://github.com/outbox-rs/outbox/blob/main/docs/operations.md#metrics))
//! and runs each batch in a `tracing` span, `outbox_relay_batch`. Every 30 s
//! ([`RelayBuilder::health_interval`]) one of its instances checks the outbox's health
//! ([`admin::health`](crate::admin::health): autovacuum off, dead rows, the cleanup horizon held
//! back, old unpublished rows, held keys, parked and dead rows) and logs each warning, naming
//! its cause, when it appears.
//!
//! # NATS JetStream
//!
//! With the `nats` feature the relay publishes to JetStream instead (a build with only `nats`
//! has no librdkafka). Everything above holds the same way: shards and batches, per-key order
//! with any number of relays, retried, held and parked records, status, health and metrics.
//! What differs is the wire, and it is documented on [`JetStream`]: a topic is the subject, the
//! partition key the `outbox_key` header, `Nats-Msg-Id` the event id (a resend within the
//! stream's duplicate window is stored once), and a row is marked published only once the
//! server acknowledged it. JetStream does not number a producer's messages the way Kafka's
//! idempotent producer does, so a key's records go out together only on condition: each one
//! behind another carries the id of the one before it (`Nats-Expected-Last-Msg-Id`), and the
//! server stores it only if that one is the stream's last message, so a refused, lost or
//! timed-out record takes the ones behind it with it. A topic that no stream captures is held, as a missing Kafka topic
//! is, unless the relay is told to create its stream.
//!
//! ```no_run
//! # #[cfg(feature = "nats")]
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_runtime::relay::{JetStream, Relay};
//!
//! let client = async_nats::connect("nats://127.0.0.1:4222").await?;
//! let relay = Relay::builder(pool)
//!     .jetstream(JetStream::new(client).create_streams(true))
//!     .build()?;
//! # Ok(()) }
//! ```
//!
//! # RabbitMQ
//!
//! With the `rabbitmq` feature the relay publishes to RabbitMQ ([`RabbitMq`]): a topic is a
//! durable direct exchange, the partition key picks one of the topic's shards (the routing
//! key), `message_id` is the event id, and every message is persistent, `mandatory` and sent
//! on a confirm channel. A row is marked published only on the server's positive confirm with
//! no return; a nack, a channel error or a confirm that does not come leaves it unpublished,
//! and a topic no queue takes (no exchange, or nothing bound to the shard) is held, as a
//! missing Kafka topic is. A key's next record goes only once the previous one is confirmed,
//! and names it (the `outbox_previous_event_id` header: the event id of the key's last message
//! this process published on the topic, if it remembers one), so that a consumer can put
//! redelivered messages back in their key's order.
//!
//! ```no_run
//! # #[cfg(feature = "rabbitmq")]
//! # fn run(pool: sqlx::PgPool) -> outbox_runtime::Result<()> {
//! use outbox_runtime::relay::{RabbitMq, Relay};
//!
//! let relay = Relay::builder(pool)
//!     .rabbitmq(RabbitMq::new("amqp://guest:guest@127.0.0.1:5672"))
//!     .build()?;
//! # Ok(()) }
//! ```
//!
//! # MariaDB and MySQL
//!
//! With the `mysql` feature the relay publishes the outbox of a MariaDB 10.6+ or MySQL 8.0.1+
//! database: give the builder a `MySqlPool` (migrated with
//! [`mysql::migrate`](crate::mysql::migrate)). Per-key order with any number of instances,
//! retried, held and parked records and [`Relay::status`] hold as above; what differs (no
//! cursor, shards through `GET_LOCK`, READ COMMITTED, wake-up in process and adaptive polling
//! instead of `NOTIFY`; health checks and retention not yet) is in [`crate::mysql`].
//!
//! ```no_run
//! # #[cfg(all(feature = "mysql", feature = "kafka"))]
//! # fn run(pool: sqlx::MySqlPool) -> outbox_runtime::Result<()> {
//! use outbox_runtime::relay::Relay;
//!
//! let relay = Relay::builder(pool).brokers("127.0.0.1:9092").build()?;
//! # Ok(()) }
//! ```
//!
//! # CloudEvents
//!
//! Consumers outside this framework (Knative, another language's CloudEvents SDK) can read the
//! events as [CloudEvents](https://cloudevents.io) (Kafka protocol binding, binary content mode);
//! [`CloudEvents`] lists the attributes written and how a replay keeps them, and the
//! [`inbox`](crate::inbox#cloudevents) consumers read such records too.
//!
//! ```no_run
//! use outbox_runtime::relay::{CloudEvents, Relay};
//!
//! fn relay(pool: sqlx::PgPool) -> outbox_runtime::Result<Relay> {
//!     Relay::builder(pool)
//!         .brokers("127.0.0.1:9092")
//!         // every topic; or `CloudEvents::new(..).topics(["order.events"])` for some
//!         .cloud_events(CloudEvents::new("/orders-service"))
//!         .build()
//! }
//! ```

#[cfg(feature = "_broker")]
/// `$work.await`, or an error once `$limit` (the failover timeout) passed without an answer: a
/// database that does not answer for that long has ended the session (or will), and the shards
/// are someone else's by now. (A macro: a generic function over the future trips the compiler's
/// `Send` analysis of the callers' futures.)
macro_rules! bounded {
    ($database:expr, $limit:expr, $work:expr) => {{
        let limit: std::time::Duration = $limit;
        match tokio::time::timeout(limit, $work).await {
            Ok(result) => result,
            Err(_) => Err(crate::error::Error::Database(sqlx::Error::Io(
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "{} did not answer the relay within the failover timeout ({limit:?})",
                        $database
                    ),
                ),
            ))),
        }
    }};
}

#[cfg(feature = "_broker")]
mod builder;
#[cfg(feature = "_broker")]
mod floor;
#[cfg(feature = "_broker")]
mod gauges;
#[cfg(feature = "_broker")]
mod health;
#[cfg(feature = "_broker")]
mod instance;
#[cfg(all(feature = "_broker", feature = "mysql"))]
mod mysql;
#[cfg(feature = "_broker")]
mod outcomes;
#[cfg(feature = "_broker")]
mod periodic;
#[cfg(feature = "_broker")]
mod run;
#[cfg(feature = "_broker")]
mod settings;
#[cfg(feature = "_broker")]
mod wakeup;

use std::time::Duration;

use sqlx::PgPool;

pub use crate::admin::RelayStatus;
use crate::error::Result;

/// The relay's JetStream settings; also at [`crate::nats::JetStream`].
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use crate::nats::JetStream;
#[cfg(feature = "_broker")]
pub use crate::publish::CloudEvents;
/// The relay's RabbitMQ settings; also at [`crate::rabbitmq::RabbitMq`].
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub use crate::rabbitmq::RabbitMq;
#[cfg(feature = "_broker")]
pub use crate::store::database::Database;
#[cfg(feature = "_broker")]
pub use builder::RelayBuilder;
/// Hooks of this project's own benchmarks (features `testing` and `mysql`); not API.
#[cfg(all(feature = "testing", feature = "mysql"))]
#[doc(hidden)]
pub use mysql::drain_mysql_without_broker;
#[cfg(feature = "_broker")]
pub use run::Relay;
/// Hooks of this project's own tests and benchmarks (feature `testing`); not API.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub use {
    floor::claim_floor,
    run::{drain_without_broker, explain_claim},
};

/// The relay's backlog figures, from the database alone (one aggregate: what `Relay::status`
/// and the relay's gauges read; [`admin::status`](crate::admin::status) has them per topic).
#[cfg_attr(not(feature = "_broker"), allow(dead_code))]
pub(crate) async fn status(pool: &PgPool) -> Result<RelayStatus> {
    let (unpublished, retrying, held, parked, age) = crate::store::relay::backlog(pool).await?;
    Ok(RelayStatus {
        unpublished,
        retrying,
        held,
        parked,
        oldest_unpublished_age: age.map(|s| Duration::from_secs_f64(s.max(0.0))),
    })
}
