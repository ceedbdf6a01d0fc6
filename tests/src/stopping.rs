//! A consumer told to stop with a backlog waiting: it finishes the batch in hand and takes no
//! other. One stop may take no more by luck (a choice between "stop" and "the next batch" made
//! without priority is right half the time), so the drill stops a consumer of the group
//! several times over one backlog.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_runtime::inbox::Consumer;

use crate::payments::wait_for;
use crate::Running;

/// The state of the drill's handler (`payments_kit!`'s `mark_paid_counted`): how many times it
/// was called, over every consumer of the drill.
#[derive(Clone, Default)]
pub struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    /// One more call.
    pub fn add(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Batches of this many payments: what the consumers of the drill are to be built with.
pub const BATCH: usize = 50;
/// Stops, each from a new consumer of the group.
const ROUNDS: usize = 8;

/// Stops a consumer of the group `start` builds (given the state to count its handler's calls
/// in, with batches of [`BATCH`]) [`ROUNDS`] times over a backlog of `orders` payments, each
/// time once it has handled some: from the stop asked for to its end, it may finish the batch
/// in hand, no more. Then a last consumer of the group drains the backlog: each payment took
/// effect once. `count`: the database's count of a query's rows.
pub async fn stops_after_the_batch_in_hand<F, Fut>(
    orders: i64,
    start: impl Fn(Counted) -> Consumer,
    count: F,
) where
    F: Fn(&'static str) -> Fut,
    Fut: Future<Output = i64>,
{
    let counted = Counted::default();
    for round in 0..ROUNDS {
        let running = Running::consumer(&start(counted.clone()));
        let begun = counted.get();
        wait_for(
            "a batch or two handled",
            Duration::from_secs(60),
            || async { counted.get() >= begun + BATCH + 10 },
        )
        .await;
        running.cancel();
        let asked = counted.get();
        running.stop().await;
        let after = counted.get() - asked;
        assert!(
            after <= BATCH,
            "round {round}: {after} handled after the stop was asked for, with batches of \
             {BATCH}: the consumer took another batch of its backlog"
        );
    }
    assert!(
        counted.get() < usize::try_from(orders).unwrap(),
        "the backlog ran out during the drill: make it longer"
    );
    let running = Running::consumer(&start(counted.clone()));
    wait_for("the backlog drained", Duration::from_secs(120), || async {
        count("SELECT COUNT(*) FROM orders WHERE paid > 0").await == orders
    })
    .await;
    running.stop().await;
    assert_eq!(
        count("SELECT COUNT(*) FROM orders WHERE paid <> 1").await,
        0,
        "a payment took effect more than once"
    );
}
