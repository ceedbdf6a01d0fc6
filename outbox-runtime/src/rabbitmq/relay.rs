//! The relay's RabbitMQ transport: claimed rows published (as `wire.rs` makes them) on a
//! channel in confirm mode (`confirm.rs`), `mandatory`, each counted as published once the
//! server confirmed it and did not return it; a missing exchange found before the first
//! publish (a publish to one closes the channel, and every unconfirmed publish on it).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amqprs::channel::{ExchangeDeclareArguments, ExchangeType};

use super::confirm::{self, Confirming};
use super::link::{
    close_channel, open_channel, timed, ACCESS_REFUSED, NOT_FOUND, PRECONDITION_FAILED,
};
use super::previous::Previous;
use super::settings::RabbitMq;
use super::wire::{self, check_exchange, shard_of};
use crate::error::PublishError;
use crate::publish::{
    order, Boxed, Class, CloudEvents, Options, Outcome, PerKey, Sender, Transport,
};
use crate::store::record::Claimed;

/// The relay's (or a replay's) transport to `settings`' server: `timeout` bounds each wait
/// for it (the relay bounds each batch's).
pub(crate) fn transport(settings: &RabbitMq, timeout: Duration) -> Box<dyn Transport> {
    Box::new(Publisher {
        settings: settings.clone(),
        within: timeout,
        open: tokio::sync::Mutex::new(None),
        exchanges: Arc::new(Mutex::new(HashSet::new())),
        missing: Mutex::new(HashMap::new()),
        previous: Arc::default(),
    })
}

impl Transport for Publisher {
    fn publish<'a>(&'a self, rows: &'a [Claimed], options: Options<'a>) -> Boxed<'a, Vec<Outcome>> {
        Box::pin(order::publish(self, rows, options))
    }

    fn ready(&self, within: Duration) -> Boxed<'_, Result<(), String>> {
        Box::pin(async move {
            let mut open = self.open.lock().await;
            self.connected(&mut open, within).await.map(|_| ())
        })
    }
}

/// A relay's RabbitMQ publisher, shared by its instances.
pub(crate) struct Publisher {
    settings: RabbitMq,
    within: Duration,
    /// The confirm channel, opened on first use and again once it closed.
    open: tokio::sync::Mutex<Option<Confirming>>,
    /// Exchanges found (or declared): looked up again once a publish finds one missing.
    exchanges: Arc<Mutex<HashSet<String>>>,
    /// Topics found without an exchange, and when: looked up again only after
    /// [`MISSING_KEPT`], so that a held topic's many keys cost one lookup, not one each.
    missing: Mutex<HashMap<String, Instant>>,
    /// Each key's last published event, which its next message names.
    previous: Arc<Previous>,
}

/// How long a topic found without an exchange is taken to have none.
const MISSING_KEPT: Duration = Duration::from_secs(1);

impl Publisher {
    /// The open confirm channel, opened (again) if there is none or it closed.
    async fn connected<'o>(
        &self,
        open: &'o mut Option<Confirming>,
        within: Duration,
    ) -> Result<&'o mut Confirming, String> {
        if open.as_ref().is_some_and(|o| !o.is_open()) {
            if let Some(old) = open.take() {
                old.give_up("the connection closed, or a confirm was given up waiting for");
            }
        }
        if open.is_none() {
            let exchanges = Some(Arc::clone(&self.exchanges));
            *open = Some(Confirming::open(&self.settings, "relay", within, exchanges).await?);
        }
        Ok(open.as_mut().expect("opened above"))
    }

    fn exchange_known(&self, topic: &str) -> bool {
        self.exchanges
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(topic)
    }

    /// Finds `topic`'s exchange, or declares it (if told to), on a channel of its own (a
    /// passive declare that finds nothing closes its channel).
    async fn ensure_exchange(&self, topic: &str) -> Result<(), Outcome> {
        let missing = || {
            Outcome::Held(PublishError::RabbitMq(format!(
                "no exchange `{topic}`: declare it (`outbox topics ensure --transport rabbitmq`, \
                 or let the relay: RabbitMq::declare_topology)"
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
        let deferred = |e: String| Outcome::Deferred(PublishError::RabbitMq(e));
        let connection = {
            let mut open = self.open.lock().await;
            let open = self
                .connected(&mut open, self.within)
                .await
                .map_err(deferred)?;
            open.link.connection.clone()
        };
        let (channel, closed) = open_channel(&connection, self.within)
            .await
            .map_err(deferred)?;
        let mut args = ExchangeDeclareArguments::of_type(topic, ExchangeType::Direct);
        args.durable(true).passive(!self.settings.declare);
        let declared = timed(
            self.within,
            &format!("cannot declare the exchange `{topic}`"),
            channel.exchange_declare(args),
        )
        .await;
        close_channel(channel);
        match declared.map_err(|e| (closed.code(), closed.explain(e))) {
            Ok(()) => {
                self.exchanges
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(topic.to_owned());
                Ok(())
            }
            Err((Some(NOT_FOUND), _)) => {
                self.missing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(topic.to_owned(), Instant::now());
                Err(missing())
            }
            Err((code, e)) => Err(classify(code).outcome(PublishError::RabbitMq(e))),
        }
    }
}

/// Sorts the reply code a server closed a channel with (none: the connection failed or a wait
/// timed out) into a [`Class`].
fn classify(code: Option<u16>) -> Class {
    match code {
        // Refused, or an exchange of that name exists with another type or durability: an
        // operator's to fix, as a missing topic is.
        Some(NOT_FOUND | ACCESS_REFUSED | PRECONDITION_FAILED) => Class::Operator,
        _ => Class::Transient,
    }
}

impl Sender for Publisher {
    type Delivery = Delivery;

    // RabbitMQ numbers no producer's messages: a refused (nacked, returned) message does not
    // stop the ones behind it, so a key's next one goes only once this one is confirmed.
    const IN_FLIGHT: PerKey = PerKey::OneInFlight;

    async fn send(
        &self,
        row: &Claimed,
        cloud_events: Option<&CloudEvents>,
    ) -> Result<Delivery, Outcome> {
        let rejected = |reason: String| Outcome::Rejected(PublishError::RabbitMq(reason));
        check_exchange(&row.topic).map_err(rejected)?;
        let previous = self
            .previous
            .of(&row.topic, &row.partition_key, row.event_id);
        let (properties, body) = wire::message(row, previous, cloud_events).map_err(rejected)?;
        if !self.exchange_known(&row.topic) {
            self.ensure_exchange(&row.topic).await?;
        }
        let shard = shard_of(&row.partition_key, self.settings.shards).to_string();
        let deferred = |e: String| Outcome::Deferred(PublishError::RabbitMq(e));
        let mut open = self.open.lock().await;
        let channel = self
            .connected(&mut open, self.within)
            .await
            .map_err(deferred)?;
        match channel
            .publish(&row.topic, &shard, properties, body, self.within)
            .await
        {
            Ok(confirmed) => {
                let keys = Arc::clone(&self.previous);
                let (topic, key, event) =
                    (row.topic.clone(), row.partition_key.clone(), row.event_id);
                Ok(Delivery {
                    confirmed: Box::pin(async move {
                        let outcome = confirm::outcome(confirmed).await;
                        if outcome == Outcome::Published {
                            keys.published(&topic, &key, event, previous);
                        }
                        outcome
                    }),
                    stale: Some(Arc::clone(&channel.stale)),
                })
            }
            Err(e) => {
                // The tag may or may not have been used: this channel's numbers are no longer
                // known, so it is given up.
                if let Some(old) = open.take() {
                    old.give_up(&e);
                }
                Err(deferred(e))
            }
        }
    }
}

/// A message on its way, until the server confirms, refuses or returns it. Dropped before
/// that (its wait timed out), it marks its channel stale: a confirm lost or late leaves the
/// channel's state unknown, and the relay opens another rather than wait on it again.
pub(crate) struct Delivery {
    confirmed: Pin<Box<dyn Future<Output = Outcome> + Send>>,
    /// The channel's flag, until the outcome is in.
    stale: Option<Arc<AtomicBool>>,
}

impl Future for Delivery {
    type Output = Outcome;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Outcome> {
        let polled = self.confirmed.as_mut().poll(cx);
        if polled.is_ready() {
            self.stale = None;
        }
        polled
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if let Some(stale) = self.stale.take() {
            stale.store(true, Ordering::Relaxed);
        }
    }
}
