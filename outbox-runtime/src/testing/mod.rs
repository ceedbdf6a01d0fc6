//! A test kit for applications (feature `testing`, turned on in the application's
//! `[dev-dependencies]`): inside its own `#[tokio::test]` or `#[sqlx::test]`, against its test
//! database, without a Kafka broker.
//!
//! - [`emitted`] reads back the events of one type a command emitted (committed, or still in
//!   the test's transaction after a flush), [`emitted_records`] every row with its metadata.
//! - [`deliver`] hands an event to a handler the way a dedup-mode consumer does (the same code):
//!   through its JSON payload, in a transaction with the `processed_event` record, panics caught,
//!   an aborted transaction detected; delivered twice, it runs once. [`deliver_with`] adds the
//!   consumer's state and the message's metadata
//!   (`MessageMeta::new(id, event_type, topic).with_attempt(2)`...).
//! - [`MockKafka`] is librdkafka's mock cluster, in the test's process: a real relay publishes
//!   to it ([`MockKafka::relay_pending`]) and [`MockKafka::records`] reads what it published.
//! - On MariaDB/MySQL (with the feature `mysql`): [`deliver`], [`deliver_with`] and
//!   [`MockKafka::relay_pending`] take a `MySqlPool` (and a handler of `&mut MySqlConnection`)
//!   as they take a `PgPool`; `testing::mysql` reads the outbox there (`emitted`,
//!   `emitted_records`).
//!
//! `tests/tests/testing_kit.rs` in the repository runs this against a real database:
//!
//! ```no_run
//! use outbox_runtime::inbox::HandlerError;
//! use outbox_runtime::testing::{self, Delivery, MockKafka};
//! use outbox_runtime::{OutboxEvent, Uow};
//!
//! // The application's event, command and handler.
//! #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize, OutboxEvent)]
//! #[outbox(topic = "order.events", aggregate_type = "Order")]
//! struct OrderPlaced { #[outbox(aggregate_id)] order_id: uuid::Uuid, amount: i64 }
//!
//! async fn place_order(pool: &sqlx::PgPool, amount: i64) -> outbox_runtime::Result<uuid::Uuid> {
//!     let order_id = uuid::Uuid::now_v7();
//!     let mut uow = Uow::begin(pool).await?;
//!     sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, $2)")
//!         .bind(order_id).bind(amount).execute(uow.tx()).await?;
//!     uow.emit(&OrderPlaced { order_id, amount }).await?;
//!     uow.commit().await?;
//!     Ok(order_id)
//! }
//!
//! #[outbox_runtime::inbox_handler]
//! async fn reserve_stock(event: OrderPlaced, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
//!     sqlx::query("INSERT INTO reservations (order_id) VALUES ($1)")
//!         .bind(event.order_id).execute(tx).await?;
//!     Ok(())
//! }
//!
//! // Its tests.
//! async fn checks(pool: &sqlx::PgPool) -> outbox_runtime::Result<()> {
//!     // What a command emitted.
//!     let order_id = place_order(pool, 250).await?;
//!     assert_eq!(testing::emitted::<OrderPlaced>(pool).await?, vec![OrderPlaced { order_id, amount: 250 }]);
//!
//!     // A handler, run as a dedup-mode consumer runs it; the same id again is a duplicate.
//!     let event = OrderPlaced { order_id, amount: 250 };
//!     let id = testing::emitted_records(pool).await?[0].event_id;
//!     assert_eq!(testing::deliver(pool, "stock", reserve_stock, id, &event).await?, Delivery::Handled);
//!     assert_eq!(testing::deliver(pool, "stock", reserve_stock, id, &event).await?, Delivery::Duplicate);
//!
//!     // The real relay, publishing to librdkafka's mock cluster in the test's process.
//!     let kafka = MockKafka::start()?;
//!     kafka.create_topic("order.events", 3)?;
//!     assert_eq!(kafka.relay_pending(pool).await?, 1);
//!     assert_eq!(kafka.records("order.events").await?.len(), 1);
//!     Ok(())
//! }
//! ```

use std::sync::Arc;

use serde::de::DeserializeOwned;
use sqlx::{PgExecutor, Row};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::inbox::batch;
use crate::inbox::database::Db;
use crate::inbox::message::Incoming;
use crate::inbox::route::Routes;
use crate::inbox::{ConsumerDatabase, Handler, MessageMeta};

mod mock_kafka;
#[cfg(feature = "mysql")]
pub mod mysql;

pub use mock_kafka::{MockKafka, Record};

/// The events of type `E` in the outbox, the oldest first: committed ones, or, given the test's
/// own transaction (`&mut *tx`), the ones it emitted so far (after
/// [`Uow::flush`](crate::Uow::flush): a unit of work writes its events at commit).
pub async fn emitted<'e, E>(db: impl PgExecutor<'e>) -> Result<Vec<E>>
where
    E: OutboxEvent + DeserializeOwned,
{
    let payloads: Vec<serde_json::Value> = sqlx::query_scalar(
        "SELECT payload FROM outbox_event WHERE topic = $1 AND event_type = $2 ORDER BY id",
    )
    .bind(E::TOPIC)
    .bind(E::EVENT_TYPE)
    .fetch_all(db)
    .await?;
    payloads
        .into_iter()
        .map(|p| {
            serde_json::from_value(p).map_err(|e| Error::Database(sqlx::Error::Decode(e.into())))
        })
        .collect()
}

/// One outbox row, as [`emitted_records`] reads it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct EmittedRecord {
    /// The event's id: the `event_id` header its consumers deduplicate by.
    pub event_id: Uuid,
    /// The topic the relay publishes it to.
    pub topic: String,
    /// The Kafka record key.
    pub partition_key: String,
    /// The aggregate's type.
    pub aggregate_type: String,
    /// The aggregate's id.
    pub aggregate_id: String,
    /// The event's type: the `event_type` header.
    pub event_type: String,
    /// The payload.
    pub payload: serde_json::Value,
    /// Whether a relay has published it.
    pub published: bool,
    /// Its stored headers, which the relay sends after its own: the application's (from
    /// `emit_with`), a captured `traceparent`/`tracestate`, and [`SCHEMA_VERSION_HEADER`]
    /// when the event's version is not 1. Empty for most events.
    ///
    /// [`SCHEMA_VERSION_HEADER`]: crate::SCHEMA_VERSION_HEADER
    pub headers: Vec<(String, String)>,
    /// The event's schema version (`#[outbox(version = N)]`, 1 by default).
    pub schema_version: u32,
}

impl EmittedRecord {
    /// The value of its stored header named `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        first_header(&self.headers, name)
    }
}

/// Every row of the outbox, the oldest first (see [`emitted`] for which rows a connection sees).
pub async fn emitted_records<'e>(db: impl PgExecutor<'e>) -> Result<Vec<EmittedRecord>> {
    let rows = sqlx::query(
        "SELECT event_id, topic, partition_key, aggregate_type, aggregate_id, event_type, \
             payload, published_at IS NOT NULL AS published, headers \
         FROM outbox_event ORDER BY id",
    )
    .fetch_all(db)
    .await?;
    rows.iter()
        .map(|row| {
            let headers: Vec<(String, String)> =
                match row.try_get::<serde_json::Value, _>("headers")? {
                    serde_json::Value::Object(map) => map
                        .into_iter()
                        .filter_map(|(k, v)| match v {
                            serde_json::Value::String(v) => Some((k, v)),
                            _ => None,
                        })
                        .collect(),
                    _ => Vec::new(),
                };
            let schema_version = first_header(&headers, crate::SCHEMA_VERSION_HEADER)
                .and_then(|v| v.parse().ok())
                .unwrap_or(1);
            Ok(EmittedRecord {
                event_id: row.try_get("event_id")?,
                topic: row.try_get("topic")?,
                partition_key: row.try_get("partition_key")?,
                aggregate_type: row.try_get("aggregate_type")?,
                aggregate_id: row.try_get("aggregate_id")?,
                event_type: row.try_get("event_type")?,
                payload: row.try_get("payload")?,
                published: row.try_get("published")?,
                headers,
                schema_version,
            })
        })
        .collect()
}

/// The value of the first of `headers` named `name`.
pub(crate) fn first_header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// What became of an event given to [`deliver`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Delivery {
    /// The handler ran and its transaction committed, with the event's deduplication record.
    Handled,
    /// The event's deduplication record was there: the handler did not run.
    Duplicate,
    /// The handler failed (or panicked, or left its transaction aborted): nothing of it was
    /// committed. A consumer would retry it (`retryable`, up to its `max_attempts`) or
    /// dead-letter it at once; `reason` is what its dead letter would say.
    Failed {
        /// Whether a consumer would try it again.
        retryable: bool,
        /// The failure, as the consumer records it.
        reason: String,
    },
}

/// Hands `event`, with id `event_id`, to `handler` as a dedup-mode consumer of group `group`
/// does (the same code): its payload serialized and deserialized, the handler run in a
/// transaction that also records `(event_id, "<group>/<handler>")` in `processed_event`,
/// panics caught, an aborted transaction detected. Handing it over again with the same id is a
/// [`Delivery::Duplicate`]. The handler's metadata is [`MessageMeta::new`]'s with the event's
/// own schema version: first attempt, no partition, offset, key or headers; [`deliver_with`]
/// sets state and metadata.
///
/// Its error is the database's (the schema is not migrated, the connection failed); a
/// handler's failure is a [`Delivery::Failed`].
///
/// On MariaDB/MySQL (a `MySqlPool`, a handler taking `&mut MySqlConnection`) it runs the
/// consumers' batch of those databases, the same way.
pub async fn deliver<D, H>(
    pool: &sqlx::Pool<D>,
    group: &str,
    handler: H,
    event_id: Uuid,
    event: &H::Event,
) -> Result<Delivery>
where
    D: ConsumerDatabase,
    H: Handler<(), D>,
{
    let topic = <H::Event as OutboxEvent>::TOPIC;
    let meta = MessageMeta::new(event_id, <H::Event as OutboxEvent>::EVENT_TYPE, topic)
        .with_schema_version(<H::Event as OutboxEvent>::SCHEMA_VERSION);
    deliver_with(pool, group, handler, (), &meta, event).await
}

/// [`deliver`] with the consumer's application `state` and the message's metadata `meta`
/// (its event id is the deduplication key; routing uses the event's own topic and type; its
/// schema version is the one the handler is asked to accept, so for an event of version 2 or
/// later give [`MessageMeta::with_schema_version`] its `SCHEMA_VERSION`: `MessageMeta::new`
/// says 1).
pub async fn deliver_with<S, D, H>(
    pool: &sqlx::Pool<D>,
    group: &str,
    handler: H,
    state: S,
    meta: &MessageMeta<'_>,
    event: &H::Event,
) -> Result<Delivery>
where
    S: Send + Sync + 'static,
    D: ConsumerDatabase,
    H: Handler<S, D>,
{
    let payload = event.payload_json().map_err(|source| Error::Payload {
        event_type: <H::Event as OutboxEvent>::EVENT_TYPE.into(),
        source,
    })?;
    let mut routes = Routes::default();
    routes
        .add(handler, Arc::new(state))
        .map_err(Error::Config)?;
    routes.bind_group(group).map_err(Error::Config)?;
    let mut meta = meta.clone();
    meta.topic = <H::Event as OutboxEvent>::TOPIC;
    meta.event_type = <H::Event as OutboxEvent>::EVENT_TYPE.into();
    let message = Incoming {
        source_partition: meta.partition,
        meta,
        payload: payload.as_bytes(),
    };
    let messages = [Ok(message)];
    let handled = match D::db(pool.clone()) {
        Db::Postgres(pool) => batch::handle(&pool, &routes, &messages, false, None).await,
        #[cfg(feature = "mysql")]
        Db::MySql(pool) => {
            crate::inbox::batch_mysql::handle(&pool, &routes, &messages, false, None).await
        }
    };
    let outcome = match handled {
        Ok(outcome) => outcome,
        Err(batch::Unhandled::Database(e)) => return Err(e),
        Err(batch::Unhandled::LeaseLost) => unreachable!("a batch without a fence"),
    };
    Ok(match outcome.failed.into_iter().next() {
        Some((_, failure)) => Delivery::Failed {
            retryable: !failure.is_permanent(),
            reason: failure.message().to_owned(),
        },
        None if outcome.duplicates > 0 => Delivery::Duplicate,
        None => Delivery::Handled,
    })
}
