//! CloudEvents' protocol bindings, binary content mode: the event's attributes as headers
//! (`ce_*` on Kafka, `ce-*` on NATS), its data (the JSON payload) as the record's value.

use std::collections::BTreeSet;

/// The CloudEvents specification version the relay writes.
pub(crate) const SPEC_VERSION: &str = "1.0";

/// Publishes events as [CloudEvents](https://cloudevents.io) in the Kafka binding's binary
/// content mode, so that consumers outside this framework (Knative, other languages'
/// CloudEvents SDKs) read them as CloudEvents. Given to
/// [`RelayBuilder::cloud_events`](crate::relay::RelayBuilder::cloud_events) (and
/// [`Replay::cloud_events`](crate::admin::Replay::cloud_events), so a replay is in the same
/// format).
///
/// Each record of a topic it covers gets, besides the framework's own headers (which this
/// crate's consumers read, and other readers ignore):
///
/// | header | CloudEvents attribute | value |
/// |---|---|---|
/// | `ce_specversion` | `specversion` | `1.0` |
/// | `ce_id` | `id` | the event id (a UUID) |
/// | `ce_source` | `source` | the source given here, e.g. `/orders-service` |
/// | `ce_type` | `type` | the event type |
/// | `ce_time` | `time` | when the event was emitted (RFC 3339, UTC, milliseconds) |
/// | `ce_subject` | `subject` | the aggregate id |
/// | `content-type` | `datacontenttype` | `application/json` |
///
/// The record's key is the partition key, as always (the binding's `partitionkey`). Other
/// extension attributes are the application's headers: `emit_with(&e, [("ce_tenant", "acme")])`.
///
/// ```
/// use outbox_runtime::relay::CloudEvents;
/// // Every topic:
/// let all = CloudEvents::new("/orders-service");
/// // Only these:
/// let some = CloudEvents::new("/orders-service").topics(["order.events"]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    source: String,
    /// `None`: every topic.
    topics: Option<BTreeSet<String>>,
}

impl CloudEvents {
    /// CloudEvents on every topic, with this `source` (a URI reference naming the producer,
    /// such as `/orders-service` or `urn:example:orders`).
    pub fn new(source: impl Into<String>) -> Self {
        CloudEvents {
            source: source.into(),
            topics: None,
        }
    }

    /// Only on these topics; the others keep the plain format.
    #[must_use]
    pub fn topics<I, T>(mut self, topics: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        self.topics = Some(topics.into_iter().map(Into::into).collect());
        self
    }

    /// Why the settings are wrong, if they are: an empty source, or one with whitespace or
    /// control characters (a URI reference has none); an empty topic list.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.source.is_empty() {
            return Err("CloudEvents source must not be empty".into());
        }
        if self
            .source
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(format!(
                "CloudEvents source `{}` is not a URI reference: it contains whitespace or a \
                 control character",
                self.source.escape_debug()
            ));
        }
        if self.topics.as_ref().is_some_and(BTreeSet::is_empty) {
            return Err("CloudEvents for an empty list of topics: give at least one".into());
        }
        Ok(())
    }

    /// Whether records of `topic` are CloudEvents.
    pub(crate) fn covers(&self, topic: &str) -> bool {
        self.topics.as_ref().is_none_or(|t| t.contains(topic))
    }

    /// The CloudEvents attributes of an event, named without the binding's prefix
    /// (`specversion`, `id`, ...).
    pub(crate) fn attributes<'a>(
        &'a self,
        event: &Attributes<'a>,
    ) -> impl Iterator<Item = (&'static str, std::borrow::Cow<'a, str>)> + 'a {
        use std::borrow::Cow;
        let time = chrono::DateTime::from_timestamp_millis(event.created_at_ms)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
        [
            ("specversion", Cow::Borrowed(SPEC_VERSION)),
            ("id", Cow::Borrowed(event.id)),
            ("source", Cow::Borrowed(self.source.as_str())),
            ("type", Cow::Borrowed(event.event_type)),
            ("subject", Cow::Borrowed(event.subject)),
        ]
        .into_iter()
        .chain(time.map(|time| ("time", Cow::Owned(time))))
    }
}

/// What a record's CloudEvents attributes are made of.
pub(crate) struct Attributes<'a> {
    pub id: &'a str,
    pub event_type: &'a str,
    pub subject: &'a str,
    pub created_at_ms: i64,
}
