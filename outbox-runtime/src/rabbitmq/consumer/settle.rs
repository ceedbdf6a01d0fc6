//! How a shard's reader settles what it handled: the `Reading` the broker-neutral core
//! calls (a message checked, its earlier attempts, a run of messages settled: retries to the
//! delay queue, dead letters to the dead-letter queue, each confirmed, then one
//! acknowledgement), and a delivered message as the core sees it.

use super::*;

impl Reader {
    /// Acknowledges delivery `tag` and every one before it on this channel (`multiple`): the
    /// batches are settled in the order delivered, so everything before `tag` is settled
    /// already. A lost acknowledgement (the channel closed) brings the messages again,
    /// deduplicated.
    pub(super) async fn ack_up_to(&self, tag: u64) -> bool {
        let guard = self.channel.lock().await;
        let Some(channel) = guard.as_ref() else {
            return false;
        };
        let acked = crate::rabbitmq::link::timed(
            ANSWER_WITHIN,
            "cannot acknowledge",
            channel
                .link
                .channel
                .basic_ack(BasicAckArguments::new(tag, true)),
        )
        .await;
        match acked {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(error = %e, tag, "cannot acknowledge a message; it comes again");
                false
            }
        }
    }

    /// Sends delivery `tag` back to its queue (`basic.reject` with `requeue`), behind what is
    /// there; `false` if the channel closed (the message then comes back anyway).
    pub(super) async fn send_back(&self, tag: u64) -> bool {
        let guard = self.channel.lock().await;
        let Some(channel) = guard.as_ref() else {
            return false;
        };
        crate::rabbitmq::link::timed(
            ANSWER_WITHIN,
            "cannot send a message back",
            channel
                .link
                .channel
                .basic_reject(BasicRejectArguments::new(tag, true)),
        )
        .await
        .is_ok()
    }

    /// Publishes `properties` and `msg`'s body to queue `queue` through the default exchange
    /// and waits until the server confirmed it, trying again (after the outage backoff) while
    /// it is refused; `false` if the channel closed or `cancel` fired first (the original is
    /// then not acknowledged: it comes again). `what` names it in messages.
    async fn forward(
        &self,
        msg: &Received,
        queue: &str,
        properties: BasicProperties,
        what: &str,
    ) -> bool {
        let mut failures = 0u32;
        let mut blocked: Option<metrics::Gauge> = None;
        loop {
            let published = {
                let mut guard = self.channel.lock().await;
                let Some(channel) = guard.as_mut().filter(|c| c.is_open()) else {
                    return false;
                };
                channel
                    .publish(
                        "",
                        queue,
                        properties.clone(),
                        msg.body.clone(),
                        ANSWER_WITHIN,
                    )
                    .await
            };
            let outcome = match published {
                Ok(confirmed) => confirm::outcome(confirmed).await,
                Err(_) => return false,
            };
            if outcome == Outcome::Published {
                break;
            }
            failures += 1;
            if blocked.is_none() {
                tracing::error!(queue, outcome = ?outcome,
                    "cannot publish a message to its {what} queue (does it exist? may this consumer \
                     publish to it?); the shard's reading waits until it can");
                let gauge =
                    metrics::gauge!("outbox_consumer_forward_blocked", "topic" => queue.to_owned());
                gauge.set(1.0);
                blocked = Some(gauge);
            }
            if self.rabbitmq.declare {
                let guard = self.channel.lock().await;
                if let Some(channel) = guard.as_ref() {
                    let _ = self
                        .topology()
                        .declare(&channel.link.channel, self.shard, ANSWER_WITHIN)
                        .await;
                }
            }
            let wait = self.shared.settings.outage_backoff(failures);
            tokio::select! {
                () = self.cancel.cancelled() => return false,
                () = tokio::time::sleep(wait) => {}
            }
        }
        if let Some(gauge) = blocked {
            gauge.set(0.0);
            tracing::info!(queue, "the {what} queue takes messages again; consuming");
        }
        true
    }

    /// How often `msg` came back unsettled: the server's count, less the times this session
    /// sent it back (no attempt at it).
    fn returned(&self, msg: &Received) -> u32 {
        let trips = self.returns().trips_of(&msg.decoded);
        msg.decoded.returned.saturating_sub(trips)
    }

    fn source(&self) -> wire::Source<'_> {
        wire::Source {
            topic: &self.topic,
            group: self.shared.settings.group(),
            shard: self.shard,
        }
    }
}

impl Reading for Reader {
    type Message = Received;

    fn check<'m>(&self, msg: &'m Received) -> Checked<'m> {
        let delivered = Delivered {
            topic: &msg.topic,
            partition: i32::from(self.shard),
            offset: 0,
            key: msg.decoded.key.as_deref(),
            payload: &msg.body,
        };
        let headers = msg
            .decoded
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), Some(value.as_slice())));
        let mut incoming = message::check(delivered, headers)?;
        incoming.meta.attempt = incoming.meta.attempt.saturating_add(self.returned(msg));
        Ok(incoming)
    }

    fn failed_before(&self, msg: &Received) -> u32 {
        let retried = msg
            .decoded
            .headers
            .iter()
            .find(|(name, _)| name == message::headers::ATTEMPTS)
            .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u32>().ok())
            .unwrap_or(0);
        retried.saturating_add(self.returned(msg))
    }

    /// Acknowledges what committed; a message to retry is first published to the shard's
    /// delay queue (expiring when due), a dead letter to the dead-letter queue, each confirmed
    /// before the original is acknowledged.
    async fn settle(
        &self,
        done: &[Received],
        failed: Vec<Option<(Destination, String)>>,
        _cancel: &CancellationToken,
    ) -> bool {
        let from = self.source();
        for (msg, failed) in done.iter().zip(failed) {
            match failed {
                None => {}
                Some((Destination::Retry { attempts, due_ms }, reason)) => {
                    let delay = u64::try_from(due_ms - message::now_ms()).unwrap_or(0);
                    let properties = wire::retry(
                        msg.properties.as_ref(),
                        &from,
                        &reason,
                        attempts,
                        due_ms,
                        delay,
                    );
                    let queue = self.topology().delay_queue(self.shard);
                    if !self.forward(msg, &queue, properties, "delay").await {
                        return false;
                    }
                    metrics::counter!("outbox_consumer_retried_total").increment(1);
                    tracing::info!(topic = %self.topic, shard = self.shard, attempts, reason,
                        "handler failed; retried after its backoff through the delay queue");
                }
                Some((Destination::DeadLetter { attempts }, reason)) => {
                    let properties =
                        wire::dead_letter(msg.properties.as_ref(), &from, &reason, attempts);
                    if !self
                        .forward(msg, &self.dead_letters, properties, "dead-letter")
                        .await
                    {
                        return false;
                    }
                    metrics::counter!("outbox_consumer_dead_lettered_total").increment(1);
                    tracing::warn!(topic = %self.topic, shard = self.shard, reason, "message dead-lettered");
                }
            }
        }
        // One acknowledgement for the whole run of messages (they are contiguous, and what
        // came before them on this channel is settled); the careful consumer's last one waits.
        match done.last() {
            Some(last) if self.defer.load(Ordering::SeqCst) => {
                self.deferred.store(last.tag, Ordering::SeqCst);
                true
            }
            Some(last) => self.ack_up_to(last.tag).await,
            None => true,
        }
    }
}
