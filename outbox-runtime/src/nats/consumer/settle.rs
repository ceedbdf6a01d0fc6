//! How the topic's reader settles what it handled: the `Reading` the broker-neutral core
//! calls (a message checked, its earlier deliveries, the lease each transaction checks, what
//! is worked on reported, a batch settled: acknowledged, refused with a delay to be retried,
//! or dead-lettered and then terminated).

use super::*;

impl Reader {
    /// Waits `wait` still working on `messages`; `false` if `cancel` fires first.
    async fn wait(&self, messages: &[Received], wait: Duration) -> bool {
        let waited = self.working_on(messages, async {
            tokio::select! {
                () = self.cancel.cancelled() => false,
                () = tokio::time::sleep(wait) => true,
            }
        });
        waited.await
    }

    /// Publishes `msg` to its topic's dead-letter subject (its payload and headers, with
    /// `dlq_error`, `dlq_attempts` and where it was read: `dlq_source_topic`,
    /// `dlq_source_partition` 0, `dlq_source_offset` its stream sequence, `dlq_source_stream`),
    /// waits until a stream stored it, then terminates the original. While no stream takes it,
    /// the topic's reading waits, saying so (`outbox_consumer_forward_blocked`). `false` if
    /// `cancel` fires first.
    async fn dead_letter(&self, msg: &Received, reason: &str, attempts: u32) -> bool {
        let subject = self.shared.settings.topics.dead_letter(&self.topic);
        let message = msg.dead_letter(&self.topic, reason, attempts);
        let mut failures = 0u32;
        let mut blocked: Option<metrics::Gauge> = None;
        loop {
            let sent = async {
                let ack = self
                    .context
                    .send_publish(subject.clone(), message.clone())
                    .await?;
                ack.await
            };
            let e = match self.working_on(std::slice::from_ref(msg), sent).await {
                Ok(_) => break,
                Err(e) => e,
            };
            failures += 1;
            if blocked.is_none() {
                tracing::error!(error = %crate::error_chain(&e), subject = %subject,
                    "cannot publish a message to its dead-letter subject (does a stream capture \
                     it? may this consumer publish to it?); the topic's reading waits until it \
                     can");
                let gauge =
                    metrics::gauge!("outbox_consumer_forward_blocked", "topic" => subject.clone());
                gauge.set(1.0);
                blocked = Some(gauge);
            }
            if let Some(create) = self.create_streams() {
                if let Err(Lookup::Failed(e)) =
                    stream_for(&self.context, &subject, Some(create)).await
                {
                    tracing::debug!(error = %e, "cannot create the dead-letter stream");
                }
            }
            let wait = self.shared.settings.outage_backoff(failures);
            if !self.wait(std::slice::from_ref(msg), wait).await {
                return false;
            }
        }
        if let Some(gauge) = blocked {
            gauge.set(0.0);
            tracing::info!(subject = %subject, "the dead-letter subject takes messages again; consuming");
        }
        msg.settle(AckKind::Term).await;
        metrics::counter!("outbox_consumer_dead_lettered_total").increment(1);
        tracing::warn!(topic = %self.topic, sequence = msg.sequence, reason, "message dead-lettered");
        true
    }
}

impl Reading for Reader {
    type Message = Received;

    fn check<'m>(&self, msg: &'m Received) -> Checked<'m> {
        msg.check()
    }

    fn failed_before(&self, msg: &Received) -> u32 {
        msg.delivered - 1
    }

    fn fence(&self) -> Option<Fence<'_>> {
        self.lease.as_ref().map(Lease::fence)
    }

    async fn working_on<F: std::future::Future>(
        &self,
        messages: &[Received],
        work: F,
    ) -> F::Output {
        Reader::working_on(self, messages, work).await
    }

    /// Acknowledges what committed; then a message to retry is refused (`nak`) with its
    /// backoff as the delay, so that the server delivers it again then and nothing else waits
    /// for it; a dead letter is published, stored by a stream, and only then the original
    /// terminated.
    async fn settle(
        &self,
        done: &[Received],
        failed: Vec<Option<(Destination, String)>>,
        _cancel: &CancellationToken,
    ) -> bool {
        for (msg, failed) in done.iter().zip(&failed) {
            if failed.is_none() {
                msg.settle(AckKind::Ack).await;
            }
        }
        for (msg, failed) in done.iter().zip(failed) {
            match failed {
                None => {}
                Some((Destination::Retry { attempts, due_ms }, reason)) => {
                    metrics::counter!("outbox_consumer_retried_total").increment(1);
                    tracing::info!(topic = %self.topic, sequence = msg.sequence, attempts,
                        reason, "handler failed; redelivered after its backoff");
                    let delay = u64::try_from(due_ms - message::now_ms()).unwrap_or(0);
                    msg.settle(AckKind::Nak(Some(Duration::from_millis(delay))))
                        .await;
                }
                Some((Destination::DeadLetter { attempts }, reason)) => {
                    let stored = self.dead_letter(msg, &reason, attempts).await;
                    if !stored {
                        return false; // cancelled: it comes again
                    }
                }
            }
        }
        true
    }
}
