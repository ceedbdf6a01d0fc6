//! A channel in confirm mode: publishes matched to the server's confirms by delivery tag, for
//! the relay (every row) and the consumer (a retry or dead letter, stored before the original
//! is acknowledged).
//!
//! The channel numbers its publishes from 1 in the order they are sent, and every publish goes
//! out under `&mut self`, which takes the next number: so the numbers are the server's. The
//! server returns an unroutable message before it confirms it, on the same channel, and the
//! client hands both to one callback in that order: so a confirm finds its message already
//! marked returned.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use amqprs::callbacks::ChannelCallback;
use amqprs::channel::{BasicPublishArguments, Channel};
use amqprs::{Ack, BasicProperties, Cancel, CloseChannel, Nack, Return};
use tokio::sync::oneshot;

use super::link::{timed, CloseReason, Link};
use super::settings::RabbitMq;
use crate::error::PublishError;
use crate::publish::Outcome;

/// An open channel in confirm mode.
pub(crate) struct Confirming {
    pub(crate) link: Link,
    /// Set once a publish's outcome was given up waiting for (its confirm may come late or
    /// never): the channel is then no longer trusted, and given up before the next use.
    pub(crate) stale: Arc<std::sync::atomic::AtomicBool>,
    confirms: Arc<Confirms>,
    /// The delivery tag of the next publish.
    next_tag: u64,
}

impl Confirming {
    /// Connects and opens a channel in confirm mode. `exchanges`: exchanges known to exist,
    /// from which one the server says is missing (a publish to it closed the channel) is
    /// removed.
    pub(crate) async fn open(
        settings: &RabbitMq,
        name: &str,
        within: Duration,
        exchanges: Option<Arc<Mutex<HashSet<String>>>>,
    ) -> Result<Confirming, String> {
        let confirms = Arc::new(Confirms::default());
        let callback = |closed| Callback {
            confirms: Arc::clone(&confirms),
            exchanges,
            closed,
        };
        let link = Link::confirming(settings, name, within, callback).await?;
        Ok(Confirming {
            link,
            stale: Arc::default(),
            confirms,
            next_tag: 1,
        })
    }

    /// Whether the connection and channel are open, and nothing was given up waiting on them.
    pub(crate) fn is_open(&self) -> bool {
        self.link.is_open() && !self.stale.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Publishes a message (`mandatory`: returned if no queue takes it) and returns what
    /// resolves to its outcome: [`Outcome::Published`] once confirmed and not returned,
    /// [`Outcome::Held`] if returned, [`Outcome::Deferred`] if refused or the channel closed
    /// first. `Err`: not sent; the channel is no longer usable (give it up).
    pub(crate) async fn publish(
        &mut self,
        exchange: &str,
        routing_key: &str,
        properties: BasicProperties,
        body: Vec<u8>,
        within: Duration,
    ) -> Result<oneshot::Receiver<Outcome>, String> {
        let tag = self.next_tag;
        let message_id = properties.message_id().cloned().unwrap_or_default();
        let Some(confirmed) = self.confirms.wait(tag, message_id) else {
            return Err("the channel closed".into());
        };
        let mut args = BasicPublishArguments::new(exchange, routing_key);
        args.mandatory(true);
        let sent = timed(
            within,
            "cannot publish",
            self.link.channel.basic_publish(properties, body, args),
        )
        .await;
        self.next_tag += 1;
        sent.map(|()| confirmed)
    }

    /// Gives the channel up: what waits for a confirm is told `reason`, the connection closed.
    pub(crate) fn give_up(self, reason: &str) {
        self.confirms.close(reason.to_owned());
        self.link.close();
    }
}

/// What resolves a publish's outcome: the channel given up before its confirm is a deferral.
pub(crate) async fn outcome(confirmed: oneshot::Receiver<Outcome>) -> Outcome {
    confirmed.await.unwrap_or_else(|_| {
        Outcome::Deferred(PublishError::RabbitMq(
            "the channel was given up before the server confirmed it".into(),
        ))
    })
}

/// The publishes a channel's server has not confirmed yet, by delivery tag.
#[derive(Default)]
struct Confirms {
    state: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    waiting: BTreeMap<u64, Waiting>,
    /// Tags by message id, for a return (which names no tag) to find its publish.
    by_id: HashMap<String, Vec<u64>>,
    /// Set once the channel closed: what is still waiting will not be confirmed.
    closed: Option<String>,
}

struct Waiting {
    message_id: String,
    returned: Option<String>,
    done: oneshot::Sender<Outcome>,
}

impl Confirms {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for tag `tag`'s confirm; `None` if the channel closed already.
    fn wait(&self, tag: u64, message_id: String) -> Option<oneshot::Receiver<Outcome>> {
        let mut pending = self.lock();
        if pending.closed.is_some() {
            return None;
        }
        let (done, confirmed) = oneshot::channel();
        pending
            .by_id
            .entry(message_id.clone())
            .or_default()
            .push(tag);
        pending.waiting.insert(
            tag,
            Waiting {
                message_id,
                returned: None,
                done,
            },
        );
        Some(confirmed)
    }

    /// Settles tag `tag` (and every earlier one with `multiple`) with `outcome` (a returned
    /// message's own outcome is `Held`).
    fn settle(&self, tag: u64, multiple: bool, outcome: impl Fn() -> Outcome) {
        let mut pending = self.lock();
        let tags: Vec<u64> = if multiple {
            pending.waiting.range(..=tag).map(|(t, _)| *t).collect()
        } else {
            vec![tag]
        };
        for t in tags {
            let Some(waiting) = pending.waiting.remove(&t) else {
                continue;
            };
            if let Some(list) = pending.by_id.get_mut(&waiting.message_id) {
                list.retain(|x| *x != t);
                if list.is_empty() {
                    pending.by_id.remove(&waiting.message_id);
                }
            }
            let result = match waiting.returned {
                Some(reason) => Outcome::Held(PublishError::RabbitMq(reason)),
                None => outcome(),
            };
            let _ = waiting.done.send(result);
        }
    }

    /// Everything still waiting is given up: `reason` says why.
    fn close(&self, reason: String) {
        let mut pending = self.lock();
        for (_, waiting) in std::mem::take(&mut pending.waiting) {
            let _ = waiting
                .done
                .send(Outcome::Deferred(PublishError::RabbitMq(format!(
                    "not confirmed: {reason}"
                ))));
        }
        pending.by_id.clear();
        pending.closed = Some(reason);
    }
}

/// The channel's callback: confirms, returns and its closing, told to [`Confirms`].
struct Callback {
    confirms: Arc<Confirms>,
    exchanges: Option<Arc<Mutex<HashSet<String>>>>,
    closed: CloseReason,
}

#[async_trait::async_trait]
impl ChannelCallback for Callback {
    async fn close(
        &mut self,
        _channel: &Channel,
        close: CloseChannel,
    ) -> std::result::Result<(), amqprs::error::Error> {
        self.closed.note(&close);
        let text = close.to_string();
        // 404 on a publish: its exchange is gone; look it up again before the next.
        if let Some(exchanges) = self
            .exchanges
            .as_ref()
            .filter(|_| text.contains("no exchange"))
        {
            exchanges
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|name| !text.contains(&format!("'{name}'")));
        }
        tracing::info!(close = %text, "RabbitMQ closed a confirm channel");
        self.confirms.close(format!("the channel closed ({text})"));
        Ok(())
    }

    async fn cancel(
        &mut self,
        _channel: &Channel,
        _cancel: Cancel,
    ) -> std::result::Result<(), amqprs::error::Error> {
        Ok(())
    }

    async fn flow(
        &mut self,
        _channel: &Channel,
        active: bool,
    ) -> std::result::Result<bool, amqprs::error::Error> {
        Ok(active)
    }

    async fn publish_ack(&mut self, _channel: &Channel, ack: Ack) {
        self.confirms
            .settle(ack.delivery_tag(), ack.mutiple(), || Outcome::Published);
    }

    async fn publish_nack(&mut self, _channel: &Channel, nack: Nack) {
        self.confirms
            .settle(nack.delivery_tag(), nack.multiple(), || {
                Outcome::Deferred(PublishError::RabbitMq(
                    "the server refused it (nack: a queue at its length limit, or an internal \
                 error); tried again"
                        .into(),
                ))
            });
    }

    async fn publish_return(
        &mut self,
        _channel: &Channel,
        ret: Return,
        properties: BasicProperties,
        _content: Vec<u8>,
    ) {
        let Some(id) = properties.message_id() else {
            return;
        };
        let reason = format!(
            "unroutable ({} {}): no queue is bound to the exchange `{}` for shard {} (start a \
             consumer of the topic, or run `outbox topics ensure --transport rabbitmq`; the \
             relay and consumers must use the same shard count)",
            ret.reply_code(),
            ret.reply_text(),
            ret.exchange(),
            ret.routing_key()
        );
        let mut pending = self.confirms.lock();
        let first = pending.by_id.get(id).and_then(|tags| {
            tags.iter()
                .copied()
                .find(|t| pending.waiting.get(t).is_some_and(|w| w.returned.is_none()))
        });
        if let Some(tag) = first {
            if let Some(waiting) = pending.waiting.get_mut(&tag) {
                waiting.returned = Some(reason);
            }
        }
    }
}
