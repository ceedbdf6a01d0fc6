//! The relay's JetStream transport: claimed rows published to JetStream (as `wire.rs` makes
//! them), each acknowledged once its stream stored it, and how JetStream's errors are sorted.
//!
//! # A key's messages in flight together
//!
//! One connection's publishes are stored in the order sent, but JetStream numbers no producer's
//! messages: a message refused (over the stream's maximum size, a full stream with `discard
//! new`, a subject no stream captures any more) or lost (the connection or the server gone
//! between two messages) does not stop the ones behind it, which would be stored ahead of it
//! once it is sent again. So a batch's records of a key (one topic) go as one run
//! ([`order::publish`] with [`PerKey::Chained`]), handed to the client with nothing else sent
//! on the connection in between (the relay's instances share it), and each but the first
//! carries `Nats-Expected-Last-Msg-Id`: the message id of the one before it. The server (2.9
//! on) stores it only if that is the id of the last message the stream stored, so a record
//! that failed takes the rest of its run with it ("wrong last msg ID", taken as
//! [`Outcome::Skipped`]: behind it, no attempt counted). A record refused only because another
//! writer's message was stored in between (another relay, a replay) goes again, first of its
//! run, in the batch's next wave once the one before it is acknowledged; the first of a run
//! goes only after every earlier record of its key was acknowledged, so it needs no condition.
//! What the condition rests on: the server answers a resend of a stored message as a duplicate
//! (`Nats-Msg-Id`) before it looks at the expectation, and it forgets the last message id when
//! it restarts (a condition then refuses, and the record goes again, first of a run).
//!
//! Why this and not the other conditions the server checks: `Nats-Expected-Last-Sequence` and
//! `Nats-Expected-Last-Subject-Sequence` name the sequence the previous message got, known only
//! once it is acknowledged (what one message in flight per key already waits for); a subject
//! token per key would also change the subjects consumers read, and make the server keep state
//! for every key there ever was. The price of the stream-wide condition: writers that share a
//! stream break each other's runs, and a broken run costs a round trip; it never costs more
//! round trips than one message in flight per key did, since the first of each run always
//! goes. Measured in BENCHMARKS.md ("JetStream with hot keys"): with 10 hot keys one relay
//! drains as fast as with 1,000 keys; 4 relays, on connections of their own, no faster than
//! before.

use std::collections::{HashMap, HashSet};
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self, ErrorCode};

use super::settings::JetStream;
use super::streams::{stream_for, Lookup, StreamSpec, DUPLICATE_WINDOW};
use super::wire::{check_subject, message, message_id};
use crate::error::PublishError;
use crate::publish::{
    order, Boxed, Class, CloudEvents, Options, Outcome, PerKey, Sender, Transport,
};
use crate::store::record::Claimed;

/// The relay's (or a replay's) transport to `jetstream`: `timeout` bounds the client's own
/// waits (the relay bounds each batch's), `failover` is the relay's failover timeout.
pub(crate) fn transport(
    jetstream: &JetStream,
    timeout: Duration,
    failover: Duration,
) -> Box<dyn Transport> {
    let context = jetstream::ContextBuilder::new()
        .timeout(timeout)
        .build(jetstream.client.clone());
    Box::new(Publisher {
        client: jetstream.client.clone(),
        context,
        create_streams: jetstream.create_streams,
        replicas: jetstream.replicas,
        failover,
        streams: Arc::new(Mutex::new(HashSet::new())),
        missing: Mutex::new(HashMap::new()),
        sending: tokio::sync::Mutex::new(()),
    })
}

impl Transport for Publisher {
    fn publish<'a>(&'a self, rows: &'a [Claimed], options: Options<'a>) -> Boxed<'a, Vec<Outcome>> {
        Box::pin(order::publish(self, rows, options))
    }

    fn ready(&self, within: Duration) -> Boxed<'_, Result<(), String>> {
        Box::pin(self.ready(within))
    }
}

/// A relay's JetStream publisher, shared by its instances.
pub(crate) struct Publisher {
    client: async_nats::Client,
    context: jetstream::Context,
    create_streams: bool,
    replicas: usize,
    failover: Duration,
    /// The topics a stream was found (or created) for: looked up again once a publish finds
    /// none.
    streams: Arc<Mutex<HashSet<String>>>,
    /// Topics no stream captured, and when that was seen: looked up again only after
    /// [`MISSING_KEPT`], so that a held topic's many keys cost one lookup, not one each.
    missing: Mutex<HashMap<String, Instant>>,
    /// Held while a run of one key is handed to the client, so that the relay's other
    /// instances (which share the connection) put nothing between its messages.
    sending: tokio::sync::Mutex<()>,
}

/// How long a topic found without a stream is taken to have none.
const MISSING_KEPT: Duration = Duration::from_secs(1);

impl Publisher {
    /// Whether JetStream answers (the account's information) within `within`. (Read as JSON:
    /// async-nats's `Account` does not read what a 2.9 server answers.)
    pub(crate) async fn ready(&self, within: Duration) -> Result<(), String> {
        let asked = self.client.request("$JS.API.INFO", bytes::Bytes::new());
        let answer = match tokio::time::timeout(within, asked).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => return Err(format!("JetStream: {}", crate::error_chain(&e))),
            Err(_) => return Err(format!("JetStream did not answer within {within:?}")),
        };
        match serde_json::from_slice::<serde_json::Value>(&answer.payload) {
            Ok(info) => match info.get("error") {
                None => Ok(()),
                Some(error) => Err(format!("JetStream: {error}")),
            },
            Err(e) => Err(format!("JetStream answered what is not JSON: {e}")),
        }
    }

    fn stream_known(&self, topic: &str) -> bool {
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(topic)
    }

    /// Finds the stream that captures `topic`'s subject, or creates it (if told to).
    async fn ensure_stream(&self, topic: &str) -> Result<(), Outcome> {
        let missing = || {
            Outcome::Held(PublishError::JetStream(format!(
                "no stream captures the subject `{topic}`: create one (or let the relay: \
                 JetStream::create_streams)"
            )))
        };
        let seen_missing = self
            .missing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(topic)
            .is_some_and(|at| at.elapsed() < MISSING_KEPT);
        if seen_missing {
            return Err(missing());
        }
        let create = self.create_streams.then_some(StreamSpec {
            replicas: self.replicas,
            duplicate_window: DUPLICATE_WINDOW.max(self.failover * 2),
        });
        let name = match stream_for(&self.context, topic, create).await {
            Ok(name) => name,
            Err(Lookup::Missing) => {
                self.missing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(topic.to_owned(), Instant::now());
                return Err(missing());
            }
            Err(Lookup::Failed(e)) => return Err(Outcome::Deferred(PublishError::JetStream(e))),
        };
        if let Ok(mut stream) = self.context.get_stream(&name).await {
            if let Ok(info) = stream.info().await {
                let window = info.config.duplicate_window;
                if window < self.failover {
                    tracing::warn!(stream = name, topic, ?window, failover = ?self.failover,
                        "the stream's duplicate window is shorter than the relay's failover \
                         timeout: a record a relay sends again after a failover may be stored \
                         twice");
                }
            }
        }
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(topic.to_owned());
        Ok(())
    }
}

impl Sender for Publisher {
    type Delivery = Delivery;

    // JetStream numbers no producer's messages: a refused message does not take the ones
    // behind it with it, so each of a key's messages but the first of a run expects the one
    // before it to be the stream's last (see `send_run`).
    const IN_FLIGHT: PerKey = PerKey::Chained;

    async fn send(
        &self,
        row: &Claimed,
        cloud_events: Option<&CloudEvents>,
    ) -> Result<Delivery, Outcome> {
        let _sending = self.sending.lock().await;
        self.send_after(row, None, cloud_events).await
    }

    /// A key's messages in order, each after the first with `Nats-Expected-Last-Msg-Id` set to
    /// the message id of the one before it: the server stores it only if that one is the last
    /// it stored in the stream, so a message refused, lost with a connection or a server, or
    /// still unstored when its successor arrives, takes the rest of the run with it (each
    /// refused with "wrong last msg ID", an [`Outcome::Skipped`]). Nothing else is sent on the
    /// connection meanwhile. A resend of a message already stored is acknowledged as a
    /// duplicate before the server looks at the expectation.
    async fn send_run(
        &self,
        run: &[&Claimed],
        cloud_events: Option<&CloudEvents>,
    ) -> Vec<Result<Delivery, Outcome>> {
        let _sending = self.sending.lock().await;
        let mut sent = Vec::with_capacity(run.len());
        let mut before: Option<&Claimed> = None;
        for row in run {
            let result = self.send_after(row, before, cloud_events).await;
            let failed = result.is_err();
            sent.push(result);
            if failed {
                break;
            }
            before = Some(row);
        }
        sent
    }
}

impl Publisher {
    /// Hands `row` to the client; with `before`, to be stored only right after it.
    async fn send_after(
        &self,
        row: &Claimed,
        before: Option<&Claimed>,
        cloud_events: Option<&CloudEvents>,
    ) -> Result<Delivery, Outcome> {
        if let Err(reason) = check_subject(&row.topic) {
            return Err(Outcome::Rejected(PublishError::JetStream(reason)));
        }
        let mut message = message(row, cloud_events)
            .map_err(|reason| Outcome::Rejected(PublishError::JetStream(reason)))?;
        if let Some(before) = before {
            message = message.expected_last_message_id(message_id(before));
        }
        if !self.stream_known(&row.topic) {
            self.ensure_stream(&row.topic).await?;
        }
        match self.context.send_publish(row.topic.clone(), message).await {
            Ok(ack) => Ok(Delivery {
                id: row.id,
                chained: before.is_some(),
                topic: Some(row.topic.clone()),
                streams: Arc::clone(&self.streams),
                future: ack.into_future(),
            }),
            Err(error) => Err(failed(&error)),
        }
    }
}

/// A message on its way, until the server acknowledges or refuses it.
pub(crate) struct Delivery {
    id: i64,
    /// Sent on condition that the message before it was the stream's last.
    chained: bool,
    /// To forget the topic's stream if the server says there is none.
    topic: Option<String>,
    streams: Arc<Mutex<HashSet<String>>>,
    future: <PublishAckFuture as IntoFuture>::IntoFuture,
}

impl Future for Delivery {
    type Output = Outcome;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Outcome> {
        let acked: Result<PublishAck, _> = std::task::ready!(self.future.as_mut().poll(cx));
        Poll::Ready(match acked {
            Ok(ack) => {
                tracing::trace!(
                    id = self.id,
                    stream = ack.stream,
                    sequence = ack.sequence,
                    duplicate = ack.duplicate,
                    "acknowledged"
                );
                Outcome::Published
            }
            Err(error) if self.chained && error.kind() == PublishErrorKind::WrongLastMessageId => {
                tracing::trace!(id = self.id, "refused behind its key's previous message");
                Outcome::Skipped
            }
            Err(error) => {
                if error.kind() == PublishErrorKind::StreamNotFound {
                    if let Some(topic) = self.topic.take() {
                        self.streams
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&topic);
                    }
                }
                failed(&error)
            }
        })
    }
}

/// Sorts a publish error into a [`Class`] (never `Fatal`: the client recovers by itself).
fn classify(error: &jetstream::context::PublishError) -> Class {
    match error.kind() {
        PublishErrorKind::StreamNotFound => Class::Operator,
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::MaxAckPending => Class::Transient,
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
            Class::Refused
        }
        _ => match std::error::Error::source(error)
            .and_then(|source| source.downcast_ref::<jetstream::Error>())
        {
            Some(server) => {
                classify_server(server.code(), server.error_code(), &server.to_string())
            }
            // The client could not send it (its connection task is gone).
            None => Class::Transient,
        },
    }
}

/// Sorts an error the server answered a publish with: `code` is its HTTP-like status (503 for
/// a full stream as for a server without a quorum: the error code tells them apart).
fn classify_server(code: usize, error_code: ErrorCode, text: &str) -> Class {
    match error_code {
        // The stream's store refused it: a limit with `discard new` (maximum messages, bytes,
        // messages per subject) is a refusal; a closed store or a full disk passes.
        ErrorCode::STREAM_STORE_FAILED
            if text.contains("store is closed") || text.contains("insufficient") =>
        {
            Class::Transient
        }
        ErrorCode::STREAM_STORE_FAILED | ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM => {
            Class::Refused
        }
        ErrorCode::JETSTREAM_NOT_ENABLED
        | ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT
        | ErrorCode::ACCOUNT_RESOURCES_EXCEEDED
        | ErrorCode::STREAM_NOT_FOUND => Class::Operator,
        ErrorCode::CLUSTER_NOT_AVAILABLE | ErrorCode::INSUFFICIENT_RESOURCES => Class::Transient,
        _ if code == 503 => Class::Transient,
        _ if code == 401 || code == 403 => Class::Operator,
        _ => Class::Refused,
    }
}

/// The outcome of a message that failed with `error`.
fn failed(error: &jetstream::context::PublishError) -> Outcome {
    classify(error).outcome(PublishError::JetStream(
        crate::error_chain(error).to_string(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_are_sorted_into_classes() {
        use ErrorCode as C;
        let full = "maximum messages exceeded (code 503, error code 10077)";
        assert_eq!(
            classify_server(503, C::STREAM_STORE_FAILED, full),
            Class::Refused
        );
        let disk = "insufficient storage resources available";
        assert_eq!(
            classify_server(503, C::STREAM_STORE_FAILED, disk),
            Class::Transient
        );
        assert_eq!(
            classify_server(400, C::STREAM_MESSAGE_EXCEEDS_MAXIMUM, "too big"),
            Class::Refused
        );
        assert_eq!(
            classify_server(503, C::CLUSTER_NOT_AVAILABLE, ""),
            Class::Transient
        );
        assert_eq!(classify_server(503, C(1), ""), Class::Transient);
        assert_eq!(
            classify_server(503, C::JETSTREAM_NOT_ENABLED, ""),
            Class::Operator
        );
        // Nobody classified it: an attempt, so that it cannot be retried forever.
        assert_eq!(classify_server(400, C(99_999), ""), Class::Refused);
    }
}
