//! Putting a key's redelivered messages back in order. A quorum queue hands back what a
//! departing consumer held in order, ahead of everything else, but puts a message handed back a
//! second time behind the other returns: when sessions end one after another before settling
//! it (a node restart, crashes in a row), a key's events come as 2, 3, 4, 5, 0, 1.
//!
//! Each message names its key's previous one ([`OUTBOX_PREVIOUS`](super::wire::OUTBOX_PREVIOUS))
//! and carries its outbox id, its place among its key's messages. A session's careful consumer
//! (which takes the returns one at a time) sends a returned message back (`basic.reject` with
//! `requeue`: behind the returns) when
//!
//! 1. a message of its key with a lower outbox id was sent back and is not settled yet: it must
//!    not overtake it, whatever it names; or
//! 2. the first time it comes in the session, its predecessor was neither settled in the
//!    session nor is in the database: it may be behind, among the returns. If it is, it comes
//!    before this message comes again; if not (retried through the delay queue, dead-lettered,
//!    of an event type the group does not handle, deleted by retention), this message is
//!    handled when it comes again.
//!
//! The lowest sent-back message of a key is always handled when it comes again (rule 1 does not
//! hold it, rule 2 only holds a first coming), so every round of the returns settles at least
//! one message of every key: nothing goes round for ever, and a message goes back at most
//! [`MAX_TRIPS`] times a session.

use std::collections::{BTreeSet, HashMap, HashSet};

use uuid::Uuid;

use super::super::wire::Decoded;

/// The most times a session sends one message back; past it, it is handled where it comes.
pub(super) const MAX_TRIPS: u32 = 5;

/// What a session's careful consumer did with the returns it took.
#[derive(Default)]
pub(super) struct Returns {
    /// The messages sent back, by event id: how often.
    trips: HashMap<Uuid, u32>,
    /// Each key's messages sent back and not settled since, by outbox id.
    waiting: HashMap<Vec<u8>, BTreeSet<i64>>,
    /// The messages settled (handled, retried or dead-lettered: none of them comes again).
    settled: HashSet<Uuid>,
}

/// What to do with a returned message, before the database is asked.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Next {
    Handle,
    SendBack,
    /// Send it back unless the database holds this predecessor.
    AskFor(Uuid),
}

impl Returns {
    /// What to do with returned message `m` (rules 1 and 2 of the module's docs).
    pub(super) fn next(&self, m: &Decoded) -> Next {
        if self.trips_of(m) >= MAX_TRIPS {
            return Next::Handle;
        }
        if let (Some(key), Some(id)) = (&m.key, m.outbox_id) {
            let earlier_waits = self
                .waiting
                .get(key)
                .is_some_and(|ids| ids.range(..id).next().is_some());
            if earlier_waits {
                return Next::SendBack;
            }
        }
        match (m.event_id, m.previous) {
            (Some(event), Some(previous))
                if !self.settled.contains(&previous) && !self.trips.contains_key(&event) =>
            {
                Next::AskFor(previous)
            }
            _ => Next::Handle,
        }
    }

    /// How often `m` was sent back this session (deliveries that were no attempt at it).
    pub(super) fn trips_of(&self, m: &Decoded) -> u32 {
        m.event_id
            .and_then(|event| self.trips.get(&event))
            .copied()
            .unwrap_or(0)
    }

    /// Notes that `m` was sent back.
    pub(super) fn sent_back(&mut self, m: &Decoded) {
        if let Some(event) = m.event_id {
            *self.trips.entry(event).or_default() += 1;
        }
        if let (Some(key), Some(id)) = (&m.key, m.outbox_id) {
            self.waiting.entry(key.clone()).or_default().insert(id);
        }
    }

    /// Notes that `m` was settled.
    pub(super) fn settled(&mut self, m: &Decoded) {
        if let Some(event) = m.event_id {
            self.settled.insert(event);
        }
        if let (Some(key), Some(id)) = (&m.key, m.outbox_id) {
            if let Some(ids) = self.waiting.get_mut(key) {
                ids.remove(&id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Event `n` of key `k` (its outbox id `n`), naming event `previous` if any; its event id
    /// is made of `n`, so that tests can name it.
    fn event(n: u8, previous: Option<u8>) -> Decoded {
        Decoded {
            key: Some(b"k".to_vec()),
            headers: Vec::new(),
            returned: 1,
            event_id: Some(id(n)),
            previous: previous.map(id),
            outbox_id: Some(i64::from(n)),
        }
    }

    fn id(n: u8) -> Uuid {
        Uuid::from_bytes([n; 16])
    }

    /// Plays the careful consumer over `queue` (front first), the database holding `held`:
    /// returns the order handled.
    fn play(mut queue: std::collections::VecDeque<Decoded>, held: &[u8]) -> Vec<i64> {
        let mut returns = Returns::default();
        let mut handled = Vec::new();
        while let Some(m) = queue.pop_front() {
            let back = match returns.next(&m) {
                Next::Handle => false,
                Next::SendBack => true,
                Next::AskFor(p) => !held.iter().any(|&h| id(h) == p),
            };
            if back {
                returns.sent_back(&m);
                queue.push_back(m);
            } else {
                returns.settled(&m);
                handled.push(m.outbox_id.unwrap());
            }
        }
        handled
    }

    fn queue(order: &[(u8, Option<u8>)]) -> std::collections::VecDeque<Decoded> {
        order.iter().map(|&(n, p)| event(n, p)).collect()
    }

    #[test]
    fn a_message_returned_twice_goes_before_the_ones_it_fell_behind() {
        let q = queue(&[
            (2, Some(1)),
            (3, Some(2)),
            (4, Some(3)),
            (5, Some(4)),
            (0, None),
            (1, Some(0)),
        ]);
        assert_eq!(play(q, &[]), [0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn a_predecessor_that_is_not_coming_holds_nothing_back_for_long() {
        // Event 0 names 9, which the database does not hold (another group's event type, or
        // deleted by retention) and which is not among the returns.
        let q = queue(&[(2, Some(1)), (3, Some(2)), (0, Some(9)), (1, Some(0))]);
        assert_eq!(play(q, &[]), [0, 1, 2, 3]);
        // In order already: still in order.
        assert_eq!(play(queue(&[(0, Some(9)), (1, Some(0))]), &[]), [0, 1]);
    }

    #[test]
    fn a_message_naming_no_predecessor_does_not_overtake_one_sent_back() {
        // The relay restarted between 0 and 1: 1 names nothing.
        assert_eq!(play(queue(&[(0, Some(9)), (1, None)]), &[]), [0, 1]);
    }

    #[test]
    fn returns_in_order_after_a_handled_predecessor_go_through_at_once() {
        let mut returns = Returns::default();
        let m = event(6, Some(5));
        assert_eq!(returns.next(&m), Next::AskFor(id(5)));
        returns.settled(&m);
        assert_eq!(returns.next(&event(7, Some(6))), Next::Handle);
        assert_eq!(play(queue(&[(6, Some(5)), (7, Some(6))]), &[5]), [6, 7]);
    }

    #[test]
    fn nothing_goes_round_more_than_the_trips_allowed() {
        // The worst order: each round settles one.
        let q = queue(&[
            (4, Some(3)),
            (3, Some(2)),
            (2, Some(1)),
            (1, Some(0)),
            (0, None),
        ]);
        assert_eq!(play(q, &[]), [0, 1, 2, 3, 4]);
        let long: Vec<(u8, Option<u8>)> = (1..20).rev().map(|n| (n, Some(n - 1))).collect();
        let handled = play(queue(&long), &[0]);
        assert_eq!(handled.len(), 19, "every message handled, none lost");
    }
}
