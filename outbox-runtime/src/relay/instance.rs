//! One relay instance: its connection, member slot, shards, cursor; one batch at a time.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{Executor, PgConnection, PgPool};
use tracing::Instrument;

use super::floor::Floor;
use super::settings::Settings;
use crate::error::{Error, Result};
use crate::publish::{Outcome, Transport};
use crate::store::relay::{self as store, Claim, Table};

/// What a step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// A full batch was claimed: there is probably more.
    Full,
    /// Some rows, less than a full batch: more may have committed meanwhile.
    Partial,
    /// Nothing to claim (or no shards to claim from): wait for work.
    Empty,
}

pub(super) use crate::store::shards::REBALANCE_EVERY;

/// Where the next claim starts, so that a claim never walks what earlier claims covered (rows
/// since published, whose index entries stay until a vacuum): the cost of a claim stays that of
/// a batch, whatever the backlog and the statistics.
///
/// `after` may only pass ids that are *decided*: a row whose id was drawn but whose
/// transaction has not committed yet would appear below the cursor later, and be skipped. The
/// horizon says which ids are decided. Each batch reads the id sequence (`q`) before its claim
/// locks anything, and gets its own transaction id (`xid`) when the claim locks its first row.
/// Every transaction that drew an id up to `q` had its transaction id before that
/// (`outbox_emit` takes it first), so below `xid`. Once a later batch begins with no
/// transaction older than `xid` running (its snapshot's `xmin >= xid`), all of them have ended,
/// and every id up to `q` is committed and visible, or never will be.
#[derive(Debug, Default)]
struct Cursor {
    /// The claim scans ids above this. Every unpublished row of the owned shards at or below it
    /// is parked, waiting for a retry (or held), or behind such a row of its key.
    after: i64,
    /// Every id at or below it is decided.
    horizon: i64,
    /// Sequence readings `(q, xid)` not yet known to be decided, oldest first.
    readings: VecDeque<(i64, i64)>,
}

/// Readings kept at most; more only delays the horizon (while a transaction stays open long).
const MAX_READINGS: usize = 64;

impl Cursor {
    /// After a claim whose batch was recorded (published rows marked, failures written) in
    /// transaction `xid`: `unsettled` is the lowest claimed id that is neither (its key's later
    /// rows are not held by the database; they must be claimed again).
    fn advance(&mut self, claim: &Claim, full: bool, unsettled: Option<i64>, xid: Option<i64>) {
        while let Some(&(q, xid)) = self.readings.front() {
            if xid > claim.snapshot_xmin {
                break;
            }
            self.horizon = self.horizon.max(q);
            self.readings.pop_front();
        }
        if let Some(xid) = xid {
            if self.readings.len() < MAX_READINGS {
                self.readings.push_back((claim.sequence, xid));
            }
        }
        // A full batch scanned up to its last row; a short one scanned everything.
        let scanned = match claim.rows.last() {
            Some(last) if full => last.id,
            _ => i64::MAX,
        };
        let mut after = scanned.min(self.horizon);
        if let Some(id) = unsettled {
            after = after.min(id - 1);
        }
        self.after = after.max(claim.from);
    }
}

/// One relay instance's state: its connection, member slot, owned shards and cursor.
pub(super) struct Instance<'r> {
    pool: &'r PgPool,
    settings: &'r Settings,
    /// `None` when it only measures the database's work: every row counts as acknowledged.
    transport: Option<&'r dyn Transport>,
    conn: Option<PgConnection>,
    table: Option<Table>,
    slot: i32,
    shards: BTreeSet<i32>,
    last_rebalance: Option<Instant>,
    published: u64,
    /// Whether this instance's waiting mark is set.
    waiting: bool,
    cursor: Cursor,
    /// The claims' floor on a partitioned outbox, kept by a task of the relay (`floor.rs`).
    floor: Option<Arc<Floor>>,
}

impl<'r> Instance<'r> {
    pub(super) fn new(
        pool: &'r PgPool,
        settings: &'r Settings,
        transport: Option<&'r dyn Transport>,
    ) -> Self {
        Instance {
            pool,
            settings,
            transport,
            conn: None,
            table: None,
            slot: 0,
            shards: BTreeSet::new(),
            last_rebalance: None,
            published: 0,
            waiting: false,
            cursor: Cursor::default(),
            floor: None,
        }
    }

    /// Claims from now on use `floor`.
    pub(super) fn use_floor(&mut self, floor: Arc<Floor>) {
        self.floor = Some(floor);
    }

    pub(super) fn published(&self) -> u64 {
        self.published
    }

    pub(super) fn waiting(&self) -> bool {
        self.waiting
    }

    pub(super) fn owns_shards(&self) -> bool {
        !self.shards.is_empty()
    }

    pub(super) async fn set_waiting(&mut self, waiting: bool) -> Result<()> {
        if self.waiting == waiting {
            return Ok(());
        }
        let (slot, limit) = (self.slot, self.settings.failover_timeout);
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        bounded!("PostgreSQL", limit, store::set_waiting(conn, slot, waiting))?;
        self.waiting = waiting;
        Ok(())
    }

    /// Drops the connection: the server releases its shards and any open transaction.
    pub(super) fn reset(&mut self) {
        // A mark left behind is cleared by the next instance that joins.
        self.waiting = false;
        self.conn = None;
        self.shards.clear();
        self.last_rebalance = None;
        self.cursor = Cursor::default();
    }

    /// Connects, joins the members and clears stale waiting marks, unless connected already.
    async fn connect(&mut self) -> Result<()> {
        if self.conn.is_some() {
            return Ok(());
        }
        let failover = self.settings.failover_timeout;
        let (conn, table, slot) = bounded!("PostgreSQL", failover, open(self.pool, failover))?;
        self.conn = Some(conn);
        self.table = Some(table);
        self.slot = slot;
        Ok(())
    }

    /// Rebalances shards when due, then publishes one batch.
    pub(super) async fn step(&mut self) -> Result<Step> {
        let due = self
            .last_rebalance
            .is_none_or(|t| t.elapsed() >= REBALANCE_EVERY);
        if due {
            self.connect().await?;
            let (table, slot) = (self.table.expect("connected"), self.slot);
            let limit = self.settings.failover_timeout;
            let conn = self.conn.as_mut().expect("connected above");
            let rebalance = store::rebalance(conn, table, &mut self.shards, slot);
            let gained = bounded!("PostgreSQL", limit, rebalance)?;
            if gained {
                // Rows of the new shards below the cursor are unknown to this instance.
                self.cursor.after = 0;
            }
            tracing::debug!(
                shards = store::shard_mask(&self.shards),
                gained,
                "outbox relay rebalanced"
            );
            self.last_rebalance = Some(Instant::now());
        }
        if self.shards.is_empty() {
            return Ok(Step::Empty);
        }
        let span = super::outcomes::batch_span(self.shards.len());
        // On an error the caller drops the connection (`reset`), which ends the transaction.
        self.batch().instrument(span).await
    }

    async fn batch(&mut self) -> Result<Step> {
        let relay = self.settings;
        let limit = relay.batch_size as i64;
        let table = self.table.expect("connected in step");
        let (after, failover) = (self.cursor.after, relay.failover_timeout);
        let conn = self.conn.as_mut().expect("connected in step");
        let floor = self.floor.as_ref().and_then(|f| f.get());
        let claim = bounded!(
            "PostgreSQL",
            failover,
            store::claim(conn, table, &self.shards, after, limit, floor)
        )?;
        tracing::Span::current().record("claimed", claim.rows.len());
        if claim.rows.is_empty() {
            bounded!("PostgreSQL", failover, store::abandon(conn))?;
            self.cursor.advance(&claim, false, None, None);
            return Ok(Step::Empty);
        }
        let started = Instant::now();
        let outcomes = match self.transport {
            Some(transport) => transport.publish(&claim.rows, relay.publishing()).await,
            None => claim.rows.iter().map(|_| Outcome::Published).collect(),
        };
        let super::outcomes::Sorted {
            published,
            failed,
            deferred,
            unsettled,
        } = super::outcomes::sort(&claim.rows, outcomes, relay);
        let conn = self.conn.as_mut().expect("connected in step");
        let since_ms = claim
            .rows
            .iter()
            .map(|r| r.created_at_ms)
            .min()
            .unwrap_or(0);
        let finish = store::finish(
            conn,
            &published,
            &failed,
            relay.max_attempts_i32(),
            since_ms,
        );
        let finished = bounded!("PostgreSQL", failover, finish)?;
        let parked = finished.parked;
        tracing::debug!(
            from = claim.from,
            first = claim.rows.first().map_or(0, |r| r.id),
            last = claim.rows.last().map_or(0, |r| r.id),
            claimed = claim.rows.len(),
            published = published.len(),
            failed = ?failed.iter().map(|f| f.id).collect::<Vec<_>>(),
            ?unsettled,
            shards = store::shard_mask(&self.shards),
            "outbox relay batch recorded"
        );
        let full = claim.rows.len() as i64 >= limit;
        self.cursor.advance(&claim, full, unsettled, finished.xid);
        let n = published.len() as u64;
        self.published += n;
        super::outcomes::count(n, failed.len(), parked, started);
        if let Some(error) = deferred {
            // The broker is unreachable or slow: back off like any failed batch.
            return Err(Error::Publish(error));
        }
        Ok(if claim.rows.len() as i64 >= limit {
            Step::Full
        } else {
            Step::Partial
        })
    }

    /// See [`super::explain_claim`].
    #[cfg(feature = "testing")]
    pub(super) async fn explain_claim(&mut self, cursor: i64) -> Result<serde_json::Value> {
        self.connect().await?;
        let table = self.table.expect("connected");
        let conn = self.conn.as_mut().expect("connected");
        let all: BTreeSet<i32> = (0..store::SHARDS).collect();
        store::explain_claim(conn, table, &all, cursor, self.settings.batch_size as i64).await
    }
}

/// A new relay connection: its session set up, the table resolved, a member slot taken.
async fn open(pool: &sqlx::PgPool, failover: Duration) -> Result<(PgConnection, Table, i32)> {
    let mut conn = pool.acquire().await?.detach();
    let version = conn.server_version_num().unwrap_or(0);
    conn.execute(session_settings(failover, version).as_str())
        .await?;
    let table = Table::resolve(&mut conn).await?;
    let slot = store::join(&mut conn, table).await?.ok_or_else(|| {
        Error::Config("no free relay member slot (more than 4096 relays?)".into())
    })?;
    store::clear_stale_waiting(&mut conn, slot).await?;
    Ok((conn, table, slot))
}

/// The session settings of a relay connection: PostgreSQL ends the session of a relay
/// that went silent within the failover timeout (the timeouts, TCP keepalives and
/// `tcp_user_timeout` on the server's side), and the planner can only walk indexes in
/// order (no sequential or bitmap scans, no JIT, one generic plan), so a claim's cost does
/// not depend on statistics.
fn session_settings(failover: Duration, server_version: u32) -> String {
    let ms = failover.as_millis().max(1);
    // Keepalive probes start after a third of the timeout, three of them fill the rest.
    let idle = (failover.as_secs() / 3).max(1);
    let interval = (failover.as_secs() / 5).max(1);
    let mut sql = format!(
        "SET application_name = 'outbox-relay'; \
         SET idle_in_transaction_session_timeout = {ms}; \
         SET statement_timeout = {ms}; \
         SET tcp_keepalives_idle = {idle}; \
         SET tcp_keepalives_interval = {interval}; \
         SET tcp_keepalives_count = 3; \
         SET tcp_user_timeout = {ms}; \
         SET jit = off; \
         SET enable_seqscan = off; \
         SET enable_bitmapscan = off; \
         SET plan_cache_mode = force_generic_plan"
    );
    if server_version >= 140_000 {
        sql.push_str(&format!("; SET idle_session_timeout = {ms}"));
    }
    sql
}
