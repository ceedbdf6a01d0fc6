//! The processors' floor: a `seq` below which no row is due but an operator's revival, so that
//! a claim's scans start there instead of at the inbox's oldest index entry. A processed row
//! leaves dead entries in the pending indexes until a vacuum removes them; a scan from the
//! bottom steps over all of them, so without the floor a claim's cost grows with every row
//! processed since the last vacuum (behind 100,000 of them, a claim of 100 read 907 buffers,
//! against 368 on a fresh inbox: `tests/inbox_claim.rs`),
//! and with it a claim steps over at most the rows processed since about two [`INTERVAL`]s
//! ago.
//!
//! Why it holds. A sighting reads how far the sequence was drawn (`L`), then, in a statement
//! of its own, which transactions run in this database: one that drew a `seq <= L` had begun
//! before `L` was read, so it has ended by then or is among them. Once all of them have ended,
//! a statement that begins after that sees every row with `seq <= L` that will ever exist, so
//! the oldest unprocessed, live row it sees (`oldest`) is the lowest there is among them. The
//! floor is then `min(oldest, L + 1)`: no row below it is due, nor will be. While no sighting
//! has settled (a long transaction in this database), the floor stays where it was, lowered to
//! `oldest` (a row an operator revived). Only receipts write the inbox, and never through a
//! prepared transaction.
//!
//! What a floor leaves out for at most one interval: a dead row an operator retried (its
//! `seq` is old; a dead row holds nothing back, so its key's later rows may have passed it,
//! and once revived it is handled after them).
//!
//! The sequence must not cache values per session (`CACHE 1`, as the migration makes it): a
//! value cached before a sighting could be drawn after it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::PgConnection;

use crate::store::inbox::floor as store;

/// How often a consumer's processors look again.
pub(crate) const INTERVAL: Duration = Duration::from_secs(1);

/// At most this many sightings wait for their transactions (a long transaction holds them
/// all); past it, none is added until the oldest settle.
const MAX_SIGHTINGS: usize = 64;

/// No floor: claims start at the bottom.
pub(crate) const NONE: i64 = i64::MIN;

/// A consumer's floor, shared by its processors; one of them computes it when it is due.
pub(crate) struct Floor {
    value: AtomicI64,
    /// A processor is computing it.
    busy: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    at: Option<Instant>,
    /// `(L, the transactions running then)` of each sighting not settled yet, oldest first.
    sightings: VecDeque<(i64, Vec<String>)>,
}

impl Default for Floor {
    fn default() -> Self {
        Floor {
            value: AtomicI64::new(NONE),
            busy: AtomicBool::new(false),
            state: Mutex::new(State::default()),
        }
    }
}

impl Floor {
    /// The floor for a claim, computed again first when [`INTERVAL`] has passed (by one
    /// processor; the others use the one there is). When the database cannot say, the floor
    /// stays as it was: claims go on, as safe as before.
    pub(crate) async fn get(&self, conn: &mut PgConnection) -> i64 {
        let due = self.lock().at.is_none_or(|at| at.elapsed() >= INTERVAL);
        if due && !self.busy.swap(true, Ordering::AcqRel) {
            let _busy = Busy(&self.busy);
            if let Err(e) = self.compute(conn).await {
                tracing::debug!(error = %crate::error_chain(&e), "cannot compute the inbox floor");
            }
        }
        self.value.load(Ordering::Acquire)
    }

    /// Computes the floor again; whether a sighting settled (else it only went down, if at
    /// all).
    async fn compute(&self, conn: &mut PgConnection) -> crate::Result<bool> {
        // The oldest sightings whose transactions have all ended (if one's have not, neither
        // have a later one's: a transaction still running was running at each).
        let waiting: Vec<(i64, Vec<String>)> = self.lock().sightings.iter().cloned().collect();
        let mut settled = None;
        for (i, (l, running)) in waiting.iter().enumerate() {
            if !store::ended(conn, running).await? {
                break;
            }
            settled = Some((i, *l));
        }
        // Then, in a statement that begins after those ended, the oldest row.
        let oldest = store::oldest(conn).await?;
        // A sighting for later: `L` first, then what runs.
        let drawn = store::drawn(conn).await?.unwrap_or(0);
        let running = store::running(conn).await?;
        let mut state = self.lock();
        state.at = Some(Instant::now());
        if let Some((i, _)) = settled {
            state.sightings.drain(..=i);
        }
        let old = self.value.load(Ordering::Acquire);
        let floor = match settled {
            Some((_, l)) => oldest.map_or(l + 1, |o| o.min(l + 1)),
            None => oldest.map_or(old, |o| o.min(old)),
        };
        self.value.store(floor, Ordering::Release);
        if state.sightings.len() < MAX_SIGHTINGS {
            state.sightings.push_back((drawn, running));
        }
        Ok(settled.is_some())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new floor computed until a sighting settles (the transactions running at the first
    /// have ended), or `within` has passed (`None`).
    #[cfg(feature = "testing")]
    pub(crate) async fn settled(
        pool: &sqlx::PgPool,
        within: Duration,
    ) -> crate::Result<Option<i64>> {
        let floor = Floor::default();
        let mut conn = pool.acquire().await?;
        let deadline = Instant::now() + within;
        loop {
            if floor.compute(&mut conn).await? {
                return Ok(Some(floor.value.load(Ordering::Acquire)));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Clears the busy flag when the computation ends, however it ends.
struct Busy<'a>(&'a AtomicBool);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}
