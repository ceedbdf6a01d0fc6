//! Sending a batch's rows through a broker's client so that no key overtakes itself, and
//! waiting for the broker's acknowledgements: what every transport shares. What a record is on
//! each broker, and how its errors are sorted, is in that broker's folder.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::Duration;

use super::cloudevents::CloudEvents;
use crate::error::PublishError;
use crate::store::record::Claimed;

/// What became of one record.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The broker acknowledged it, and every earlier record of its key in the batch.
    Published,
    /// Refused: counts as an attempt (the record is parked after `max_attempts`). Errors known
    /// to be permanent (too large, invalid, policy), and errors nobody classified, which must
    /// not be retried forever either.
    Rejected(PublishError),
    /// Refused for an operator's reason (unknown topic or stream, not authorized): the key
    /// waits until it is fixed; not an attempt, never parked (unless the relay is told to).
    Held(PublishError),
    /// Not sent, or not acknowledged, for a passing reason (broker down, publish timeout, a
    /// producer that failed for good): stays unpublished, for a later batch.
    Deferred(PublishError),
    /// Not sent, or sent and not counted, because an earlier record of its key did not go
    /// through: stays unpublished, behind it.
    Skipped,
}

/// How one batch is to be published.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Options<'a> {
    /// The longest the batch waits for acknowledgements.
    pub(crate) timeout: Duration,
    /// How many records of a key may be in flight (a transport may allow fewer).
    pub(crate) per_key: PerKey,
    pub(crate) cloud_events: Option<&'a CloudEvents>,
}

/// How the relay treats a broker's error: each broker sorts its own errors into these
/// (`classify` in its folder), and this decides what becomes of the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// Broker down or slow, leadership moving, queue full: try again, nothing counted.
    Transient,
    /// The topic (or stream) does not exist, or the relay may not write to it: hold the key.
    Operator,
    /// The client is unusable (Kafka's fatal idempotence error): recreate it, try again.
    #[allow(dead_code)] // not every broker's client can fail for good
    Fatal,
    /// Anything else, known to be permanent or not known at all: an attempt.
    #[cfg_attr(not(any(feature = "kafka", feature = "nats")), allow(dead_code))]
    Refused,
}

impl Class {
    /// What becomes of a record that failed with `error` of this class.
    pub(crate) fn outcome(self, error: PublishError) -> Outcome {
        match self {
            Class::Transient | Class::Fatal => Outcome::Deferred(error),
            Class::Operator => Outcome::Held(error),
            Class::Refused => Outcome::Rejected(error),
        }
    }
}

/// What the relay needs of a broker's client: one record sent at a time, in the order of the
/// calls (a key's records reach the broker in the order they were sent), each acknowledged or
/// refused later on its own.
pub(crate) trait Sender {
    /// A record on its way: resolves to [`Outcome::Published`] once the broker stored it, or to
    /// the outcome of its failure.
    type Delivery: Future<Output = Outcome>;

    /// The most records of one key this broker's client may have in flight and keep in order.
    const IN_FLIGHT: PerKey;

    /// Hands one row to the client. `Err`: not sent, and why.
    async fn send(
        &self,
        row: &Claimed,
        cloud_events: Option<&CloudEvents>,
    ) -> Result<Self::Delivery, Outcome>;

    /// With [`PerKey::Chained`]: hands a key's records to the client together, in order, each
    /// after the first to be stored only right after the one before it (a delivery refused for
    /// that alone resolves to [`Outcome::Skipped`]). Stops at the first record that cannot be
    /// sent: one result per record handed over.
    async fn send_run(
        &self,
        run: &[&Claimed],
        cloud_events: Option<&CloudEvents>,
    ) -> Vec<Result<Self::Delivery, Outcome>> {
        let mut sent = Vec::with_capacity(run.len());
        for row in run {
            let result = self.send(row, cloud_events).await;
            let failed = result.is_err();
            sent.push(result);
            if failed {
                break;
            }
        }
        sent
    }
}

/// How many records of one key may be in flight at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PerKey {
    /// All of a key's records for one topic go out together; the broker keeps them in order
    /// and refuses what follows a refused one (idempotent sequence numbers).
    Pipelined,
    /// One at a time: the next only once the previous one was acknowledged. For brokers that
    /// do not check idempotent sequence numbers.
    OneInFlight,
    /// All of a key's records for one topic go out together, each but the first on condition
    /// that the one before it is what the broker stored last ([`Sender::send_run`]; JetStream's
    /// expected last message id): a record refused, lost or timed out takes the ones behind it
    /// with it, and one refused only because something else was stored in between is sent
    /// again in the next wave, once the one before it is acknowledged.
    Chained,
}

impl PerKey {
    /// The stricter of the two: a transport that allows fewer records in flight than asked.
    pub(crate) fn at_most(self, other: PerKey) -> PerKey {
        if self == PerKey::OneInFlight || other == PerKey::OneInFlight {
            PerKey::OneInFlight
        } else if self == PerKey::Chained || other == PerKey::Chained {
            PerKey::Chained
        } else {
            PerKey::Pipelined
        }
    }
}

/// Sends the rows and waits (at most the options' timeout in all) for their acknowledgements. Returns one
/// outcome per row, in the same order.
///
/// Order per key: a key's records are enqueued in `id` order, and the idempotent producer
/// keeps that order within a partition; with `enable.gapless.guarantee`, a record the broker
/// refuses fails the producer rather than letting it go on past the refused one, and a broker
/// that checks idempotent sequence numbers (Apache Kafka, Redpanda) refuses the requests that
/// were already in flight behind it. With [`PerKey::OneInFlight`] a key's next record is not
/// sent before the previous one is acknowledged, which keeps that promise on brokers that do
/// not check; a broker whose client cannot keep more in order ([`Sender::IN_FLIGHT`]) always
/// gets that. With [`PerKey::Chained`] a wave's records of a key go out as one run
/// ([`Sender::send_run`], runs in the order of their keys' first records), each on condition
/// that the one before it was stored last: once one of them fails, the later ones of its key
/// count as [`Outcome::Skipped`] whatever became of them, and those refused only because
/// something else was stored in between go again in the next wave. A record for another topic
/// than the key's records still in flight waits until
/// they are acknowledged (there is no order across partitions), in a later wave. Once a record
/// of a key fails, the later records of the key are not sent; and a later record is only
/// counted as published if every earlier one of its key was.
pub(crate) async fn publish<S: Sender>(
    sender: &S,
    rows: &[Claimed],
    options: Options<'_>,
) -> Vec<Outcome> {
    let Options {
        timeout,
        per_key,
        cloud_events,
    } = options;
    let per_key = per_key.at_most(S::IN_FLIGHT);
    let chained = per_key == PerKey::Chained;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut outcomes: Vec<Option<Outcome>> = (0..rows.len()).map(|_| None).collect();
    let mut failed_keys: HashSet<&str> = HashSet::new();
    let mut waiting: Vec<usize> = (0..rows.len()).collect();
    while !waiting.is_empty() {
        // One wave: every waiting record whose key has nothing in flight on another topic.
        let mut in_flight: HashMap<&str, &str> = HashMap::new();
        let mut held_back: HashSet<&str> = HashSet::new();
        let mut next = Vec::new();
        let mut wave = Vec::new();
        // With `Chained`: the wave's records per key, sent once the wave is known.
        let mut runs: Vec<Vec<usize>> = Vec::new();
        let mut run_of: HashMap<&str, usize> = HashMap::new();
        for i in waiting {
            let row = &rows[i];
            let key = row.partition_key.as_str();
            if failed_keys.contains(key) {
                outcomes[i] = Some(Outcome::Skipped);
                continue;
            }
            let must_wait = in_flight
                .get(key)
                .is_some_and(|t| *t != row.topic || per_key == PerKey::OneInFlight);
            if must_wait || held_back.contains(key) {
                held_back.insert(key);
                next.push(i);
                continue;
            }
            if chained {
                in_flight.insert(key, &row.topic);
                let r = *run_of.entry(key).or_insert_with(|| {
                    runs.push(Vec::new());
                    runs.len() - 1
                });
                runs[r].push(i);
                continue;
            }
            match sender.send(row, cloud_events).await {
                Ok(delivery) => {
                    in_flight.insert(key, &row.topic);
                    wave.push((i, delivery));
                }
                Err(outcome) => {
                    failed_keys.insert(key);
                    outcomes[i] = Some(outcome);
                }
            }
        }
        for run in runs {
            let records: Vec<&Claimed> = run.iter().map(|&i| &rows[i]).collect();
            let mut sent = sender.send_run(&records, cloud_events).await.into_iter();
            for i in run {
                match sent.next() {
                    Some(Ok(delivery)) => wave.push((i, delivery)),
                    Some(Err(outcome)) => {
                        failed_keys.insert(rows[i].partition_key.as_str());
                        outcomes[i] = Some(outcome);
                    }
                    None => outcomes[i] = Some(Outcome::Skipped),
                }
            }
        }
        // Keys with a record refused behind another key's: the rest of their run goes again.
        let mut again: HashSet<&str> = HashSet::new();
        for (i, delivery) in wave {
            let key = rows[i].partition_key.as_str();
            let outcome = tokio::time::timeout_at(deadline, delivery)
                .await
                .unwrap_or(Outcome::Deferred(PublishError::Timeout(timeout)));
            if chained && failed_keys.contains(key) {
                // Behind a failed record of its key: stays unpublished, behind it.
                outcomes[i] = Some(Outcome::Skipped);
                continue;
            }
            if chained && (outcome == Outcome::Skipped || again.contains(key)) {
                again.insert(key);
                next.push(i);
                continue;
            }
            if outcome != Outcome::Published {
                failed_keys.insert(key);
            }
            outcomes[i] = Some(outcome);
        }
        next.sort_unstable();
        waiting = next;
        if tokio::time::Instant::now() >= deadline {
            break;
        }
    }
    let mut outcomes: Vec<Outcome> = outcomes
        .into_iter()
        .map(|o| o.unwrap_or(Outcome::Deferred(PublishError::NotSent)))
        .collect();
    keep_key_order(rows, &mut outcomes);
    outcomes
}

/// A record counts as published only if every earlier record of its key in the batch does:
/// an acknowledgement that comes after an earlier record of the key failed is not trusted (the
/// earlier one will be sent again, and this one after it).
fn keep_key_order(rows: &[Claimed], outcomes: &mut [Outcome]) {
    let mut failed_keys: HashSet<&str> = HashSet::new();
    for (row, outcome) in rows.iter().zip(outcomes.iter_mut()) {
        let key = row.partition_key.as_str();
        if *outcome != Outcome::Published {
            failed_keys.insert(key);
        } else if failed_keys.contains(key) {
            tracing::error!(id = row.id, key, topic = %row.topic,
                "a record was acknowledged after an earlier record of its key failed; \
                 it will be sent again after that one");
            metrics::counter!("outbox_relay_out_of_order_acks_total").increment(1);
            *outcome = Outcome::Skipped;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::VecDeque;
    use std::future::Ready;

    use super::*;

    fn row(id: i64, key: &str) -> Claimed {
        Claimed {
            id,
            event_id: uuid::Uuid::nil(),
            topic: "t".to_owned(),
            partition_key: key.to_owned(),
            aggregate_type: "A".to_owned(),
            aggregate_id: key.to_owned(),
            event_type: "E".to_owned(),
            payload: "{}".to_owned(),
            attempts: 0,
            created_at_ms: 0,
            headers: None,
            replayed_at_ms: None,
        }
    }

    /// Answers each record with the next outcome scripted for its id; records the runs sent.
    struct Scripted {
        outcomes: RefCell<HashMap<i64, VecDeque<Outcome>>>,
        runs: RefCell<Vec<Vec<i64>>>,
    }

    impl Sender for Scripted {
        type Delivery = Ready<Outcome>;
        const IN_FLIGHT: PerKey = PerKey::Chained;

        async fn send(
            &self,
            row: &Claimed,
            _: Option<&CloudEvents>,
        ) -> Result<Ready<Outcome>, Outcome> {
            let next = self
                .outcomes
                .borrow_mut()
                .get_mut(&row.id)
                .and_then(|o| o.pop_front());
            Ok(std::future::ready(next.expect("an outcome scripted")))
        }

        async fn send_run(
            &self,
            run: &[&Claimed],
            cloud_events: Option<&CloudEvents>,
        ) -> Vec<Result<Ready<Outcome>, Outcome>> {
            self.runs
                .borrow_mut()
                .push(run.iter().map(|r| r.id).collect());
            let mut sent = Vec::new();
            for row in run {
                sent.push(self.send(row, cloud_events).await);
            }
            sent
        }
    }

    #[tokio::test]
    async fn chained_runs_go_again_behind_a_stranger_and_stop_behind_a_failure() {
        let rows = [
            row(1, "a"),
            row(2, "b"),
            row(3, "a"),
            row(4, "b"),
            row(5, "a"),
        ];
        let refused = || Outcome::Rejected(PublishError::NotSent);
        let script = [
            // a: 1 stored, 3 refused behind another writer's message (and so 5): both again.
            (1, vec![Outcome::Published]),
            (3, vec![Outcome::Skipped, Outcome::Published]),
            (5, vec![Outcome::Skipped, Outcome::Published]),
            // b: 2 refused; 4, stored behind it all the same (a timed-out condition), is not
            // counted and not sent again.
            (2, vec![refused()]),
            (4, vec![Outcome::Published]),
        ];
        let sender = Scripted {
            outcomes: RefCell::new(script.into_iter().map(|(id, o)| (id, o.into())).collect()),
            runs: RefCell::new(Vec::new()),
        };
        let options = Options {
            timeout: Duration::from_secs(5),
            per_key: PerKey::Pipelined,
            cloud_events: None,
        };
        let outcomes = publish(&sender, &rows, options).await;
        assert_eq!(
            outcomes,
            vec![
                Outcome::Published,
                refused(),
                Outcome::Published,
                Outcome::Skipped,
                Outcome::Published
            ]
        );
        // Runs by key, in the order of their first records; then a's rest, first of a run.
        assert_eq!(
            *sender.runs.borrow(),
            vec![vec![1, 3, 5], vec![2, 4], vec![3, 5]]
        );
    }
}
