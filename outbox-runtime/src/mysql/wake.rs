//! Wake-up without `LISTEN`/`NOTIFY`: a unit of work that commits on MariaDB or MySQL, and a
//! consumer's batch that ran handlers (which may have emitted with `mysql::emit`), bump a
//! process-wide counter, and the relays of this process, waiting for work, claim at once. A
//! relay in another process finds the rows by polling (`relay/mysql.rs`).
//!
//! One counter for the process, whatever the pool or database: a commit elsewhere costs a relay
//! one claim that finds nothing. A `watch` channel never loses a bump: a relay marks the value
//! seen before it claims, and any bump after that wakes its wait.

use std::sync::LazyLock;

use tokio::sync::watch;

static COMMITS: LazyLock<watch::Sender<u64>> = LazyLock::new(|| watch::Sender::new(0));

/// A unit of work committed (outbox rows may have become visible).
pub(crate) fn committed() {
    COMMITS.send_modify(|n| *n = n.wrapping_add(1));
}

/// How many times the relays were signalled so far.
#[cfg(feature = "testing")]
pub(crate) fn signalled() -> u64 {
    *COMMITS.borrow()
}

/// A relay's view of the commits.
pub(crate) fn subscribe() -> watch::Receiver<u64> {
    COMMITS.subscribe()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_commit_wakes_a_relay_that_saw_the_last_one() {
        let mut relay = super::subscribe();
        relay.borrow_and_update();
        assert!(!relay.has_changed().unwrap());
        super::committed();
        assert!(relay.has_changed().unwrap());
        relay.borrow_and_update();
        assert!(!relay.has_changed().unwrap());
    }
}
