//! Each key's last published event, so that the relay's next message of the key names it
//! ([`OUTBOX_PREVIOUS`](super::wire::OUTBOX_PREVIOUS)): what lets a consumer put a key's
//! redelivered messages back in order (see `consumer/returns.rs`).
//!
//! Kept in memory, for the keys published since the process started and at most
//! `2 × GENERATION` of them: the next message of a key not published for long enough names no
//! predecessor, and one whose key another relay process published meanwhile names an older
//! one. Either is a message published before it, never a later one; the consumer also keeps a
//! key's messages behind one it sent back by their outbox ids, whatever they name.

use std::collections::HashMap;
use std::sync::Mutex;

use uuid::Uuid;

/// Keys per generation: with 2 generations and ~150 bytes an entry (with a short topic and
/// key), some 15 MB at most.
const GENERATION: usize = 50_000;

/// A key's last published event and the one it named (the latter for a message sent again:
/// a publish whose confirm was lost, or a row the relay could not mark).
#[derive(Clone, Copy)]
struct Last {
    event: Uuid,
    previous: Option<Uuid>,
}

/// The keys' last events: the current generation, and the one before it (looked up, then
/// dropped when the current one is full).
#[derive(Default)]
pub(crate) struct Previous {
    generations: Mutex<[HashMap<(String, String), Last>; 2]>,
}

impl Previous {
    /// The predecessor a message of event `event`, topic `topic` and key `key` names.
    pub(crate) fn of(&self, topic: &str, key: &str, event: Uuid) -> Option<Uuid> {
        let generations = self.generations.lock().unwrap_or_else(|e| e.into_inner());
        let id = (topic.to_owned(), key.to_owned());
        let last = generations.iter().find_map(|g| g.get(&id))?;
        if last.event == event {
            last.previous
        } else {
            Some(last.event)
        }
    }

    /// Records that `event` (which named `previous`) was published.
    pub(crate) fn published(&self, topic: &str, key: &str, event: Uuid, previous: Option<Uuid>) {
        let mut generations = self.generations.lock().unwrap_or_else(|e| e.into_inner());
        let id = (topic.to_owned(), key.to_owned());
        generations[1].remove(&id);
        if generations[0].len() >= GENERATION && !generations[0].contains_key(&id) {
            generations[1] = std::mem::take(&mut generations[0]);
        }
        generations[0].insert(id, Last { event, previous });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_names_its_last_published_event() {
        let previous = Previous::default();
        let [a, b, c] = [Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7()];
        assert_eq!(previous.of("t", "k", a), None);
        previous.published("t", "k", a, None);
        assert_eq!(previous.of("t", "k", b), Some(a));
        assert_eq!(previous.of("t", "other", b), None);
        assert_eq!(previous.of("u", "k", b), None);
        previous.published("t", "k", b, Some(a));
        // Sent again, b names what it named the first time.
        assert_eq!(previous.of("t", "k", b), Some(a));
        assert_eq!(previous.of("t", "k", c), Some(b));
    }

    #[test]
    fn a_key_outlives_one_full_generation_not_two() {
        let previous = Previous::default();
        let first = Uuid::now_v7();
        previous.published("t", "first", first, None);
        for n in 0..GENERATION {
            previous.published("t", &n.to_string(), Uuid::now_v7(), None);
        }
        assert_eq!(previous.of("t", "first", Uuid::now_v7()), Some(first));
        for n in GENERATION..2 * GENERATION {
            previous.published("t", &n.to_string(), Uuid::now_v7(), None);
        }
        assert_eq!(previous.of("t", "first", Uuid::now_v7()), None);
    }
}
