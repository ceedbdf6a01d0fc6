//! The event contract (`OutboxEvent`) and the row it becomes (`OutboxRecord`). No I/O here.

use std::borrow::Cow;

use uuid::Uuid;

use crate::error::{Error, Result};

/// An event that can be written to the outbox.
///
/// Derive it; every method works without I/O.
///
/// ```
/// use outbox_runtime::OutboxEvent;
/// use uuid::Uuid;
///
/// #[derive(serde::Serialize, OutboxEvent)]
/// #[outbox(topic = "order.events", aggregate_type = "Order", event_type = "OrderCreated")]
/// struct OrderCreated {
///     #[outbox(aggregate_id)] // also the partition key unless a field has #[outbox(key)]
///     order_id: Uuid,
///     customer_id: Uuid,
///     amount: i64,
/// }
///
/// let id = Uuid::now_v7();
/// let event = OrderCreated { order_id: id, customer_id: Uuid::nil(), amount: 5 };
/// assert_eq!(event.topic(), "order.events");
/// assert_eq!(OrderCreated::EVENT_TYPE, "OrderCreated");
/// assert_eq!(event.partition_key(), id.to_string());
/// assert_eq!(event.payload().unwrap()["amount"], 5);
/// ```
///
/// # Attributes
///
/// On the struct, `#[outbox(...)]` takes:
///
/// | key | | |
/// |---|---|---|
/// | `topic = "..."` | required | the Kafka topic; a legal topic name (`[a-zA-Z0-9._-]`, at most 249 characters, not `.` or `..`) |
/// | `aggregate_type = "..."` | required | the aggregate's type, e.g. `"Order"` |
/// | `event_type = "..."` | optional | defaults to the struct's name |
/// | `version = N` | optional | the payload's schema version, from 1 (the default); see [`SCHEMA_VERSION`](Self::SCHEMA_VERSION) |
/// | `crate = "..."` | optional | path to `outbox_runtime` for crates that re-export it |
///
/// On fields:
///
/// | key | | |
/// |---|---|---|
/// | `aggregate_id` | exactly one field | any `Display` type; also the partition key unless a field has `key` |
/// | `key` | at most one field | the Kafka partition key, any `Display` type |
/// | `event_id` | at most one field | a `uuid::Uuid` used as the event id; otherwise emit generates a UUIDv7 |
///
/// The payload is the struct serialized with serde, so serde attributes apply as usual.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an outbox event",
    label = "`{Self}` does not implement `OutboxEvent`",
    note = "derive it: `#[derive(serde::Serialize, OutboxEvent)]` with \
            `#[outbox(topic = \"...\", aggregate_type = \"...\")]` and an `#[outbox(aggregate_id)]` field"
)]
pub trait OutboxEvent {
    /// The Kafka topic the relay publishes this event to.
    const TOPIC: &'static str;
    /// The aggregate's type, e.g. `"Order"`.
    const AGGREGATE_TYPE: &'static str;
    /// The event's type, e.g. `"OrderCreated"`; sent as the `event_type` header.
    const EVENT_TYPE: &'static str;
    /// The payload's schema version, `#[outbox(version = N)]`: 1 unless given. Bump it when
    /// the payload changes in a way old consumers cannot read. An event of another version
    /// than 1 carries it in the `outbox_schema_version` header ([`SCHEMA_VERSION_HEADER`]);
    /// no header means version 1. A consumer's handler accepts its event's version, the
    /// versions it declares, and those an upcaster is registered for; others go to the dead
    /// letters.
    const SCHEMA_VERSION: u32 = 1;

    /// The aggregate's id, as text.
    fn aggregate_id(&self) -> String;

    /// The Kafka record key: events with the same key keep their order.
    fn partition_key(&self) -> String;

    /// The event's own id, if a field carries one; `None` lets emit generate a UUIDv7.
    fn event_id(&self) -> Option<Uuid>;

    /// [`Self::TOPIC`].
    fn topic(&self) -> &'static str {
        Self::TOPIC
    }

    /// [`Self::EVENT_TYPE`].
    fn event_type(&self) -> &'static str {
        Self::EVENT_TYPE
    }

    /// [`Self::AGGREGATE_TYPE`].
    fn aggregate_type(&self) -> &'static str {
        Self::AGGREGATE_TYPE
    }

    /// The payload: the event serialized with serde, as JSON text.
    fn payload_json(&self) -> Result<String, serde_json::Error>;

    /// The payload as a JSON value.
    fn payload(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_str(&self.payload_json()?)
    }
}

/// One outbox row, ready to insert: an event's metadata and its payload serialized to JSON.
///
/// [`Uow::emit_all`](crate::Uow::emit_all) takes events or records, so one statement can write
/// events of several types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRecord {
    pub(crate) event_id: Uuid,
    pub(crate) topic: Cow<'static, str>,
    pub(crate) aggregate_type: Cow<'static, str>,
    pub(crate) aggregate_id: String,
    pub(crate) event_type: Cow<'static, str>,
    pub(crate) partition_key: String,
    pub(crate) payload: String,
    /// The application's headers, by name (sorted, unique); empty for most events.
    pub(crate) headers: Vec<(String, String)>,
    /// The payload's schema version (1 for most events).
    pub(crate) schema_version: u32,
    /// The trace context captured at emit (`traceparent`, `tracestate`), with the
    /// `opentelemetry` feature inside a traced span.
    pub(crate) trace: Option<(String, Option<String>)>,
}

/// The header that carries an event's schema version ([`OutboxEvent::SCHEMA_VERSION`]) when it
/// is not 1. Stored with the row's headers, so a replay sends it again.
pub const SCHEMA_VERSION_HEADER: &str = "outbox_schema_version";

/// Header names the framework sends or reads itself: `event_id`, `event_type`,
/// `aggregate_type`, `aggregate_id`, `content-type`, the CloudEvents attributes the relay writes
/// (`ce_specversion`, `ce_id`, `ce_source`, `ce_type`, `ce_time`, `ce_subject`; other `ce_*`
/// names are extension attributes, the application's), and every name starting with
/// `outbox_` or `dlq_` (its own and the consumers' retry and dead-letter headers).
pub fn is_reserved_header(name: &str) -> bool {
    matches!(
        name,
        "event_id"
            | "event_type"
            | "aggregate_type"
            | "aggregate_id"
            | "content-type"
            | "ce_specversion"
            | "ce_id"
            | "ce_source"
            | "ce_type"
            | "ce_time"
            | "ce_subject"
    ) || name.starts_with("outbox_")
        || name.starts_with("dlq_")
}

fn check_id(event_type: &'static str, what: &'static str, value: &str) -> Result<()> {
    let reason = if value.is_empty() {
        Some("is empty")
    } else if value.contains('\0') {
        Some("contains a NUL character, which PostgreSQL text cannot store")
    } else {
        None
    };
    match reason {
        None => Ok(()),
        Some(reason) => Err(Error::InvalidEvent {
            event_type: event_type.into(),
            reason: format!("{what} {reason}").into(),
        }),
    }
}

impl OutboxRecord {
    /// Validates the event and serializes its payload.
    ///
    /// Fails when the partition key or the aggregate id is empty (or holds a NUL character) or
    /// when the payload does not serialize; the error names the event type.
    pub fn from_event<E: OutboxEvent + ?Sized>(event: &E) -> Result<Self> {
        let event_type = E::EVENT_TYPE;
        let aggregate_id = event.aggregate_id();
        check_id(event_type, "aggregate id", &aggregate_id)?;
        let partition_key = event.partition_key();
        check_id(event_type, "partition key", &partition_key)?;
        let payload = event.payload_json().map_err(|source| Error::Payload {
            event_type: event_type.into(),
            source,
        })?;
        Ok(OutboxRecord {
            event_id: event.event_id().unwrap_or_else(Uuid::now_v7),
            topic: Cow::Borrowed(E::TOPIC),
            aggregate_type: Cow::Borrowed(E::AGGREGATE_TYPE),
            aggregate_id,
            event_type: Cow::Borrowed(event_type),
            partition_key,
            payload,
            headers: Vec::new(),
            schema_version: E::SCHEMA_VERSION,
            #[cfg(feature = "opentelemetry")]
            trace: crate::trace::current(),
            #[cfg(not(feature = "opentelemetry"))]
            trace: None,
        })
    }

    /// The record with the application's headers (a tenant, a correlation id, ...), stored with
    /// the row and sent as Kafka headers after the framework's own, in name order; a replay
    /// sends them again. Replaces headers given before.
    ///
    /// Fails, naming the event type and the header, for a name that is empty, given twice, or
    /// reserved ([`is_reserved_header`]), and for a NUL character, which PostgreSQL cannot store.
    pub fn with_headers<I, K, V>(mut self, headers: I) -> Result<Self>
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let mut list: Vec<(String, String)> = headers
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        list.sort_by(|a, b| a.0.cmp(&b.0));
        let refuse = |reason: String| Error::InvalidEvent {
            event_type: self.event_type.clone(),
            reason: reason.into(),
        };
        for (i, (name, value)) in list.iter().enumerate() {
            if name.is_empty() {
                return Err(refuse("a header has an empty name".into()));
            }
            if is_reserved_header(name) {
                return Err(refuse(format!(
                    "header `{name}` is reserved: the framework sends or reads it itself"
                )));
            }
            if i > 0 && list[i - 1].0 == *name {
                return Err(refuse(format!("header `{name}` is given twice")));
            }
            if name.contains('\0') || value.contains('\0') {
                return Err(refuse(format!(
                    "header `{name}` contains a NUL character, which PostgreSQL cannot store"
                )));
            }
        }
        self.headers = list;
        Ok(self)
    }

    /// The event's id: its own, or a UUIDv7 generated when the record was made.
    pub fn event_id(&self) -> Uuid {
        self.event_id
    }
    /// The Kafka topic the relay publishes it to.
    pub fn topic(&self) -> &str {
        &self.topic
    }
    /// The aggregate's type, e.g. `"Order"`.
    pub fn aggregate_type(&self) -> &str {
        &self.aggregate_type
    }
    /// The aggregate's id, as text (never empty).
    pub fn aggregate_id(&self) -> &str {
        &self.aggregate_id
    }
    /// The event's type, e.g. `"OrderCreated"`; sent as the `event_type` header.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }
    /// The Kafka record key (never empty): events with the same key keep their order.
    pub fn partition_key(&self) -> &str {
        &self.partition_key
    }
    /// The payload as JSON text.
    pub fn payload(&self) -> &str {
        &self.payload
    }
    /// The application's headers, by name.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }
    /// The payload's schema version ([`OutboxEvent::SCHEMA_VERSION`]).
    pub fn schema_version(&self) -> u32 {
        self.schema_version
    }

    /// The trace context captured when the record was made (`opentelemetry` feature): its
    /// `traceparent` and `tracestate`, stored and sent as headers unless the application gave
    /// its own `traceparent`.
    pub fn trace_context(&self) -> Option<(&str, Option<&str>)> {
        self.trace
            .as_ref()
            .map(|(parent, state)| (parent.as_str(), state.as_deref()))
    }

    /// Whether the row stores headers: the application's, a trace context, or a schema
    /// version other than 1. Rows without keep the `headers` column's default and the shorter
    /// statement.
    pub(crate) fn has_stored_headers(&self) -> bool {
        !self.headers.is_empty() || self.schema_version != 1 || self.trace.is_some()
    }

    /// The stored headers as a JSON object, for the `headers` column: the application's, the
    /// captured trace context unless the application gave a `traceparent`, and
    /// [`SCHEMA_VERSION_HEADER`] unless the version is 1.
    pub(crate) fn headers_json(&self) -> String {
        let mut object: serde_json::Map<String, serde_json::Value> = self
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        if let Some((parent, state)) = &self.trace {
            if !object.contains_key(crate::trace::TRACEPARENT) {
                object.insert(crate::trace::TRACEPARENT.to_owned(), parent.clone().into());
                match state {
                    Some(state) => {
                        object.insert(crate::trace::TRACESTATE.to_owned(), state.clone().into());
                    }
                    // No state of the emitting span's: an application's would be another
                    // trace's.
                    None => {
                        object.remove(crate::trace::TRACESTATE);
                    }
                }
            }
        }
        if self.schema_version != 1 {
            object.insert(
                SCHEMA_VERSION_HEADER.to_owned(),
                self.schema_version.to_string().into(),
            );
        }
        serde_json::Value::Object(object).to_string()
    }
}

/// What [`Uow::emit_all`](crate::Uow::emit_all) accepts: `&E` for any [`OutboxEvent`], or an
/// [`OutboxRecord`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be emitted",
    label = "expected a reference to an `OutboxEvent`, or an `OutboxRecord`",
    note = "derive `OutboxEvent` on the event type, and pass events by reference"
)]
pub trait IntoRecord {
    /// The outbox row: an event validated and serialized as by
    /// [`OutboxRecord::from_event`], or a record as it is.
    fn into_record(self) -> Result<OutboxRecord>;
}

impl<E: OutboxEvent + ?Sized> IntoRecord for &E {
    fn into_record(self) -> Result<OutboxRecord> {
        OutboxRecord::from_event(self)
    }
}

impl IntoRecord for OutboxRecord {
    fn into_record(self) -> Result<OutboxRecord> {
        Ok(self)
    }
}
