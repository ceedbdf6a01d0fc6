//! An inbox processor's shards of the partition keys (`store/shards.rs`): held through session
//! locks on the connection its batches run on, so that a key's rows are worked on by one
//! processor at a time, across every process, and a processor's batch never outlives its hold
//! (a session that ends takes its transaction with it). Its share is moved toward the fair one
//! between batches: at most every [`REBALANCE_EVERY`] while busy, at each wake-up when idle.

use std::collections::BTreeSet;
use std::time::Instant;

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};

use crate::error::{Error, Result};
use crate::store::shards::{self, Kind, Space, REBALANCE_EVERY};

/// The `application_name` of a processor's session while it holds shards, so that an
/// operator can tell its sessions (and end one: its shards go to the others).
pub(crate) const APPLICATION_NAME: &str = "outbox-inbox-processor";

/// The connection a processor's shards are held on.
enum Held {
    /// Taken out of the pool for the processor's life.
    Detached(PgConnection),
    /// Borrowed from the pool for a while (`process_inbox_pending`): its locks are released
    /// before it goes back, and it is closed instead if that did not happen.
    Pooled(PoolConnection<Postgres>),
}

/// One processor's shards and the connection that holds them.
pub(crate) struct Shards {
    pooled: bool,
    held: Option<(Held, Space, i32)>,
    /// What gives the session its own planner settings back after a claim.
    restore: String,
    owned: BTreeSet<i32>,
    members: i64,
    rebalanced: Option<Instant>,
    /// Whether it keeps what it holds ([`Shards::take_free`]).
    keep: bool,
}

impl Shards {
    /// Shards of a processor that runs for long, on a connection of its own.
    pub(crate) fn detached() -> Shards {
        Shards::new(false)
    }

    /// Shards held for a while, on a connection of the pool given back by [`Shards::release`].
    pub(crate) fn pooled() -> Shards {
        Shards::new(true)
    }

    fn new(pooled: bool) -> Shards {
        Shards {
            pooled,
            held: None,
            restore: String::new(),
            owned: BTreeSet::new(),
            members: 1,
            rebalanced: None,
            keep: false,
        }
    }

    /// The shards held, as a mask (bit `s` for shard `s`).
    pub(crate) fn mask(&self) -> i64 {
        shards::shard_mask(&self.owned)
    }

    /// How many processors held shards at the last count.
    pub(crate) fn members(&self) -> i64 {
        self.members
    }

    /// Connects and joins if not yet, and moves toward the fair share when it is time (`now`:
    /// whatever the time). Call it between batches only.
    pub(crate) async fn ready(&mut self, pool: &PgPool, now: bool) -> Result<()> {
        if self.held.is_none() {
            let mut held = self.join(pool).await?;
            self.restore = crate::store::inbox::planner_restore(conn(&mut held.0)).await?;
            self.held = Some(held);
            self.rebalanced = None;
        }
        if !self.keep
            && (now
                || self
                    .rebalanced
                    .is_none_or(|t| t.elapsed() >= REBALANCE_EVERY))
        {
            let (held, space, slot) = self.held.as_mut().expect("joined");
            let conn = conn(held);
            let (_, members) = shards::rebalance(conn, *space, &mut self.owned, *slot).await?;
            self.members = members;
            self.rebalanced = Some(Instant::now());
        }
        Ok(())
    }

    async fn join(&self, pool: &PgPool) -> Result<(Held, Space, i32)> {
        let mut held = if self.pooled {
            Held::Pooled(pool.acquire().await?)
        } else {
            Held::Detached(pool.acquire().await?.detach())
        };
        let c = conn(&mut held);
        sqlx::Executor::execute(
            &mut *c,
            format!("SET application_name = '{APPLICATION_NAME}'").as_str(),
        )
        .await?;
        let space = Space::resolve(c, Kind::Inbox).await?;
        let slot = shards::join(c, space).await?.ok_or_else(|| {
            Error::Config("no free inbox processor slot (more than 4096 processors?)".into())
        })?;
        Ok((held, space, slot))
    }

    /// Takes every shard no processor holds (after [`Shards::ready`]), and from then on
    /// keeps what it holds (no more moving toward the fair share, which would give them up
    /// again): what a one-off run does before it ends, so that no row is left to nobody.
    /// Returns whether it took any.
    pub(crate) async fn take_free(&mut self) -> Result<bool> {
        let (held, space, _) = self.held.as_mut().expect("ready");
        self.keep = true;
        shards::take_free(conn(held), *space, &mut self.owned).await
    }

    /// The connection the shards are held on, to run a batch on (after [`Shards::ready`]).
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        self.conn_and_restore().0
    }

    /// The connection, and the statement that gives it its planner settings back after a
    /// claim (`store::inbox::planner_restore`).
    pub(crate) fn conn_and_restore(&mut self) -> (&mut PgConnection, &str) {
        (
            conn(&mut self.held.as_mut().expect("ready").0),
            &self.restore,
        )
    }

    /// Gives the shards up and drops the connection (after an error on it: the server
    /// releases what the session held).
    pub(crate) fn reset(&mut self) {
        self.close_pooled();
        self.held = None;
        self.owned.clear();
        self.rebalanced = None;
        self.keep = false;
    }

    /// Gives the shards up, and the connection back to the pool.
    pub(crate) async fn release(&mut self) -> Result<()> {
        if let Some((mut held, _, _)) = self.held.take() {
            self.owned.clear();
            sqlx::Executor::execute(
                conn(&mut held),
                "SELECT pg_advisory_unlock_all(); RESET application_name",
            )
            .await?;
            // Dropped: a pooled connection goes back to the pool, holding nothing.
        }
        Ok(())
    }

    /// A pooled connection not released (after an error, or a cancelled future) is closed
    /// when dropped: back in the pool, it would go on holding the shards.
    fn close_pooled(&mut self) {
        if let Some((Held::Pooled(c), _, _)) = self.held.as_mut() {
            c.close_on_drop();
        }
    }
}

impl Drop for Shards {
    fn drop(&mut self) {
        self.close_pooled();
    }
}

fn conn(held: &mut Held) -> &mut PgConnection {
    match held {
        Held::Detached(c) => c,
        Held::Pooled(c) => c,
    }
}
