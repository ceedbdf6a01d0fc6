//! [`JetStream`]: the settings a user gives for NATS JetStream.

use std::time::Duration;

/// NATS JetStream as a relay, consumer or replay talks to it: a connected NATS client, and
/// what to do about streams. Give it to `RelayBuilder::jetstream`, `ConsumerBuilder::jetstream`
/// or `Replay::jetstream`.
///
/// # The mapping
///
/// - **Subject**: the event's topic, as it is (`order.events` is published on the subject
///   `order.events`). A topic that is not a valid subject to publish on (empty tokens, spaces,
///   wildcards) is refused like a record Kafka refuses: an attempt, parked after
///   `max_attempts`.
/// - **The partition key** is the `outbox_key` header, not a subject token: keys are any text
///   (an e-mail address, a path) and a subject token cannot hold a dot or a space; and a subject
///   per key would make the server keep state for every key there ever was. Order per key needs
///   no subject of its own: a stream stores what one connection publishes in the order it
///   arrives, and each of a key's messages in flight behind another carries
///   `Nats-Expected-Last-Msg-Id`, the id of the one before it, so that the server refuses it
///   unless that one is what the stream stored last (a message refused, lost or timed out takes
///   the ones behind it with it: never a gap).
/// - **Headers**: those a Kafka record carries (`event_id`, `event_type`, `aggregate_type`,
///   `aggregate_id`, `content-type`, `outbox_id`, the application's own, and with
///   [`CloudEvents`](crate::relay::CloudEvents) the attributes as `ce-*` headers, the NATS binding's prefix), plus
///   `outbox_key` and `outbox_timestamp_ms` (what Kafka's record key and timestamp carry).
/// - **`Nats-Msg-Id`** is the event id: the server drops a message it stored within its
///   stream's duplicate window (2 minutes by default), so what a relay sends again after a crash
///   or a lost acknowledgement is stored once. A row is marked published only once the server
///   acknowledged it (a duplicate's acknowledgement included: the stream has it).
///
/// # Streams
///
/// A stream must capture each topic's subject. By default the relay only checks: it looks the
/// stream up the first time it publishes a topic, and while none captures it, the topic's
/// records are held (as for a Kafka topic that does not exist: `outbox status` and the
/// `outbox_relay_held` gauge show it, nothing is lost, publishing resumes once the stream is
/// created). With [`create_streams(true)`](Self::create_streams) it creates a missing one
/// instead: named after the topic (`order.events` → `order_events`), capturing its subject,
/// file storage, limits retention, [`stream_replicas`](Self::stream_replicas) replicas. A
/// stream whose duplicate window is shorter than the relay's failover timeout is logged: a
/// relay's resend after a failover could then be stored twice.
#[derive(Debug, Clone)]
pub struct JetStream {
    pub(crate) client: async_nats::Client,
    pub(crate) create_streams: bool,
    pub(crate) replicas: usize,
    pub(crate) ack_wait: Duration,
}

impl JetStream {
    /// Publishes through `client` (`async_nats::connect(...)`), checking streams, not
    /// creating them.
    pub fn new(client: async_nats::Client) -> Self {
        JetStream {
            client,
            create_streams: false,
            replicas: 1,
            ack_wait: Duration::from_secs(30),
        }
    }

    /// Whether the relay creates a stream for a topic no stream captures (default `false`:
    /// the topic's records are held until an operator creates one).
    pub fn create_streams(mut self, create: bool) -> Self {
        self.create_streams = create;
        self
    }

    /// Replicas of the streams the relay creates (default 1; at most 5).
    pub fn stream_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// Consumers: how long the server waits for a delivered message's acknowledgement before
    /// it delivers the message again (the durable consumer's `ack_wait`; default 30 s, at least
    /// 1 s). A consumer that holds a message longer (a slow handler, the database out) tells
    /// the server it is still at it, so this bounds how soon a crashed consumer's messages
    /// come again, not how long a handler may take.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        if self.ack_wait < Duration::from_secs(1) {
            return Err(format!(
                "ack_wait must be at least 1 s, not {:?}",
                self.ack_wait
            ));
        }
        if !(1..=5).contains(&self.replicas) {
            return Err(format!(
                "stream_replicas must be between 1 and 5, not {}",
                self.replicas
            ));
        }
        Ok(())
    }
}
