//! [`Received`]: a message off JetStream as the consumer handles it: where it is in its stream,
//! its deliveries, its headers decoded (`wire.rs`), checked as any broker's message is, settled.

use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, AckKind};

use super::wire::{self, Decoded};
use crate::inbox::batch::Checked;
use crate::inbox::message::{self, Delivered};

/// A message off JetStream, its headers read as the Kafka consumer reads a record's (see
/// [`wire::decode`]).
pub(super) struct Received {
    message: jetstream::Message,
    /// The stream's name, the message's sequence in it, and when the stream stored it
    /// (nanoseconds since the Unix epoch).
    stream: String,
    pub(super) sequence: u64,
    stored_ns: i128,
    /// Deliveries so far, this one included: the attempt.
    pub(super) delivered: u32,
    decoded: Decoded,
}

impl Received {
    pub(super) fn new(message: jetstream::Message) -> Self {
        let (stream, sequence, stored_ns, delivered) = match message.info() {
            Ok(info) => (
                info.stream.to_owned(),
                info.stream_sequence,
                info.published.unix_timestamp_nanos(),
                u32::try_from(info.delivered).unwrap_or(u32::MAX).max(1),
            ),
            Err(_) => (String::new(), 0, 0, 1),
        };
        let decoded = wire::decode(message.headers.as_ref());
        Received {
            message,
            stream,
            sequence,
            stored_ns,
            delivered,
            decoded,
        }
    }

    /// Checked as a Kafka record is; its attempt is its delivery.
    pub(super) fn check(&self) -> Checked<'_> {
        let delivered = Delivered {
            topic: self.message.subject.as_str(),
            partition: 0,
            offset: i64::try_from(self.sequence).unwrap_or(i64::MAX),
            key: self.decoded.key.as_deref(),
            payload: &self.message.payload,
        };
        let headers = self
            .decoded
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), Some(value.as_slice())));
        let mut incoming = message::check(delivered, headers)?;
        incoming.meta.attempt = self.delivered;
        Ok(incoming)
    }

    /// Acknowledges, refuses or terminates it, or asks for more time. A settlement that does
    /// not arrive (the server away) leaves the message pending: it comes again after
    /// `ack_wait`, and is deduplicated.
    pub(super) async fn settle(&self, kind: AckKind) {
        if let Err(e) = self.message.ack_with(kind).await {
            tracing::debug!(error = %crate::error_chain(e.as_ref()), sequence = self.sequence,
                "cannot settle a message; it comes again");
        }
    }

    /// Its dead letter (see [`wire::dead_letter`]).
    pub(super) fn dead_letter(&self, topic: &str, reason: &str, attempts: u32) -> PublishMessage {
        let from = wire::Source {
            topic,
            stream: &self.stream,
            sequence: self.sequence,
            stored_ns: self.stored_ns,
        };
        let payload = self.message.payload.clone();
        wire::dead_letter(
            self.message.headers.as_ref(),
            payload,
            &from,
            reason,
            attempts,
        )
    }
}
