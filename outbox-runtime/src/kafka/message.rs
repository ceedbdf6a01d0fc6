//! A Kafka record read as a message: its place (topic, partition, offset), key, payload and
//! headers, for the consumer's broker-neutral checks (`inbox/message.rs`).

use rdkafka::message::{BorrowedMessage, Headers, Message};

use crate::inbox::message::{self, Delivered, Incoming, Origin};

/// Where `msg` was read, its key and payload.
fn delivered<'m>(msg: &'m BorrowedMessage<'_>) -> Delivered<'m> {
    Delivered {
        topic: msg.topic(),
        partition: msg.partition(),
        offset: msg.offset(),
        key: msg.key(),
        payload: msg.payload().unwrap_or_default(),
    }
}

/// Its headers as (name, value), in order. (Each header read is a call into librdkafka, on the
/// consumer's critical path: the checks read them in one pass.)
fn headers<'m>(msg: &'m BorrowedMessage<'_>) -> impl Iterator<Item = (&'m str, Option<&'m [u8]>)> {
    msg.headers()
        .into_iter()
        .flat_map(|all| all.iter().map(|h| (h.key, h.value)))
}

/// Checks what every message needs (see [`message::check`]); the attempt counts the retry
/// topics' failures.
pub(crate) fn check<'m>(msg: &'m BorrowedMessage<'_>) -> Result<Incoming<'m>, String> {
    message::check(delivered(msg), headers(msg))
}

/// When a message from a retry topic may be tried again (`None`: now, or not a retry).
pub(crate) fn due_ms(msg: &BorrowedMessage<'_>) -> Option<i64> {
    message::due_ms(headers(msg))
}

/// Where `msg` was first read (its own topic, or the one it was retried from), and how often
/// it failed before.
pub(crate) fn origin<'m>(msg: &'m BorrowedMessage<'_>) -> Origin<'m> {
    message::origin(&delivered(msg), headers(msg))
}
