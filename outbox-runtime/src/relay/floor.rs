//! The claim's floor on a partitioned outbox: a `created_at` below which no row is claimable,
//! so that claims read only the partitions from there on instead of every partition.
//!
//! Why it holds. A row's `created_at` is its transaction's start (`outbox_emit` leaves the
//! column's default, `now()`). A sighting records the time `T` and every transaction running
//! then in this database (their virtual transaction ids, which each holds from its start, and
//! the prepared transactions). Once none of them runs any more, every transaction still to write a row
//! began after `T`: no row can appear below `T` (less a margin for the clock). Below it, the
//! floor stays at the oldest row still claimable (unpublished, not parked; a retry waiting
//! counts), read after the sighting's transactions ended. So the floor is
//! `min(T - margin, oldest claimable row below it)`, and a claim with `created_at >= floor`
//! returns what one without it would.
//!
//! A transaction's start is its first statement's, a moment before it takes its virtual id (a
//! chained transaction's, `COMMIT AND CHAIN`, is that statement's, however long the commit
//! took): `T` is also no later than the oldest start this role can see in `pg_stat_activity`,
//! and the margin covers the moment. A transaction that prepared since the sighting (its
//! virtual id released, the transaction not ended) holds the sighting too.
//!
//! What can still make a row below the floor claimable is an operator's or retention's doing
//! (a parked row retried, a partition attached back) or a write that bypasses `outbox_emit`
//! with an older `created_at`. Each computation first looks below the floor, whatever the
//! sightings say: it makes such rows due (the claim takes a due row below its cursor) and
//! lowers the floor, so they wait at most one interval.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::error::Result;

/// At most this many sightings wait for their transactions (a long transaction holds them
/// all); past it, none is added until the oldest are used.
const MAX_SIGHTINGS: usize = 512;

/// The floor, shared by the task that computes it and the instance whose claims use it.
#[derive(Debug)]
pub(crate) struct Floor(AtomicI64);

/// No floor: claims read every partition.
const NONE: i64 = i64::MIN;

impl Default for Floor {
    fn default() -> Self {
        Floor(AtomicI64::new(NONE))
    }
}

impl Floor {
    /// A floor fixed at `floor`.
    pub(crate) fn at(floor: DateTime<Utc>) -> Self {
        let f = Floor::default();
        f.set(Some(floor));
        f
    }

    pub(crate) fn get(&self) -> Option<DateTime<Utc>> {
        match self.0.load(Ordering::Acquire) {
            NONE => None,
            micros => DateTime::from_timestamp_micros(micros),
        }
    }

    fn set(&self, floor: Option<DateTime<Utc>>) {
        let micros = floor.map_or(NONE, |f| f.timestamp_micros());
        self.0.store(micros, Ordering::Release);
    }
}

/// The running transactions at one moment.
struct Sighting {
    at: DateTime<Utc>,
    virtual_xids: Vec<String>,
    prepared: Vec<String>,
    /// The transaction ids running then (32 bits, as `pg_prepared_xacts` shows them): one
    /// that was preparing then is not listed among the prepared yet.
    xids: Vec<i64>,
}

/// Keeps `floor` computed every `every` until `cancel` fires (while the outbox is partitioned;
/// `None` otherwise). A failed computation keeps the last floor, which stays true.
pub(crate) async fn keep(
    pool: PgPool,
    floor: Arc<Floor>,
    every: Duration,
    margin: Duration,
    cancel: CancellationToken,
) {
    let mut sightings = VecDeque::new();
    let mut failures = 0u32;
    loop {
        match compute(&pool, &floor, margin, &mut sightings).await {
            Ok(_) => failures = 0,
            Err(e) => {
                failures += 1;
                // Once is the database going away (the relay says so itself); again and again
                // is rows below the floor not found.
                if failures % 30 == 3 {
                    tracing::warn!(failures, error = %crate::error_chain(&e), "outbox relay cannot compute its claim floor: rows made claimable below it wait");
                } else {
                    tracing::debug!(error = %crate::error_chain(&e), "outbox relay could not compute its claim floor");
                }
            }
        }
        // Until a first floor stands, soon again: the first sighting's transactions (batches,
        // emits) end within moments.
        let next = if floor.get().is_none() {
            every.min(Duration::from_millis(200))
        } else {
            every
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(next) => {}
        }
    }
}

/// One computation: records a sighting, and sets the floor from the latest whose transactions
/// have ended. Returns whether the outbox is partitioned.
async fn compute(
    pool: &PgPool,
    floor: &Floor,
    margin: Duration,
    sightings: &mut VecDeque<Sighting>,
) -> Result<bool> {
    let mut conn = pool.acquire().await?;
    let partitioned: Option<bool> = sqlx::query_scalar(
        "SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass('outbox_event')",
    )
    .fetch_one(&mut *conn)
    .await?;
    if partitioned != Some(true) {
        floor.set(None);
        sightings.clear();
        return Ok(false);
    }
    // Rows below the floor that became claimable (a parked row retried, a partition attached
    // back, a row written by hand): the floor goes down at once, whatever the sightings say.
    if let Some(current) = floor.get() {
        if let Some(below) = oldest_claimable_below(&mut conn, current).await? {
            lower(&mut conn, floor, current, below).await?;
        }
    }
    if sightings.len() < MAX_SIGHTINGS {
        // The time first: a transaction that began before it runs still, or has ended. A
        // transaction's start is its first statement's, which may be a moment older than its
        // virtual id (a chained transaction's is its COMMIT AND CHAIN's): the oldest start
        // this role can see goes in too, and the margin covers the rest.
        let at: DateTime<Utc> = sqlx::query_scalar(
            "SELECT least(clock_timestamp(), (SELECT min(xact_start) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()))",
        )
        .fetch_one(&mut *conn)
        .await?;
        let (virtual_xids, prepared, xids): (Vec<String>, Vec<String>, Vec<i64>) = sqlx::query_as(
            "SELECT ARRAY(SELECT l.virtualxid FROM pg_locks l \
                              JOIN pg_stat_activity a ON a.pid = l.pid \
                              WHERE l.locktype = 'virtualxid' AND l.granted \
                                AND l.mode = 'ExclusiveLock' AND l.pid <> pg_backend_pid() \
                                AND a.datname = current_database()), \
                        ARRAY(SELECT gid FROM pg_prepared_xacts \
                              WHERE database = current_database()), \
                        ARRAY(SELECT x::text::int8 % 4294967296 \
                              FROM pg_snapshot_xip(pg_current_snapshot()) x)",
        )
        .fetch_one(&mut *conn)
        .await?;
        sightings.push_back(Sighting {
            at,
            virtual_xids,
            prepared,
            xids,
        });
    }
    // The latest sighting whose transactions have all ended (if one has, so have those of
    // every earlier one: a transaction running at an earlier sighting and still running now
    // was running at the later one too). A transaction prepared since a sighting (its virtual id
    // gone, the transaction not) holds it too: it may have begun before.
    let mut safe = None;
    for (i, s) in sightings.iter().enumerate().rev() {
        let ended: bool = sqlx::query_scalar(
            "SELECT NOT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'virtualxid' \
                                AND granted AND virtualxid = ANY($1)) \
                AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts \
                                WHERE database = current_database() \
                                  AND (gid = ANY($2) OR prepared >= $3 \
                                       OR transaction::text::int8 = ANY($4)))",
        )
        .bind(&s.virtual_xids)
        .bind(&s.prepared)
        .bind(s.at)
        .bind(&s.xids)
        .fetch_one(&mut *conn)
        .await?;
        if ended {
            safe = Some(i);
            break;
        }
    }
    let Some(i) = safe else {
        return Ok(true);
    };
    let before = sightings[i].at
        - chrono::Duration::from_std(margin).unwrap_or_else(|_| chrono::Duration::days(1));
    sightings.drain(..i);
    let oldest = oldest_claimable_below(&mut conn, before).await?;
    let new = oldest.map_or(before, |o| o.min(before));
    match floor.get() {
        // A row below it appeared since the check above.
        Some(current) if new < current => lower(&mut conn, floor, current, new).await?,
        _ => floor.set(Some(new)),
    }
    Ok(true)
}

/// The `created_at` of the oldest claimable row (unpublished, not parked; a retry waiting
/// counts) created before `before`, if any.
async fn oldest_claimable_below(
    conn: &mut sqlx::PgConnection,
    before: DateTime<Utc>,
) -> Result<Option<DateTime<Utc>>> {
    Ok(sqlx::query_scalar(
        "SELECT min(created_at) FROM outbox_event \
         WHERE published_at IS NULL AND parked_at IS NULL AND created_at < $1",
    )
    .bind(before)
    .fetch_one(conn)
    .await?)
}

/// Lowers the floor from `current` to `new`: the rows below `current` became claimable since
/// it was set (a parked row retried, a partition attached back, a row written by hand), so
/// they are made due first, for a claim to take them below its cursor too.
async fn lower(
    conn: &mut sqlx::PgConnection,
    floor: &Floor,
    current: DateTime<Utc>,
    new: DateTime<Utc>,
) -> Result<()> {
    let due = sqlx::query(
        "UPDATE outbox_event SET next_attempt_at = now() \
         WHERE published_at IS NULL AND parked_at IS NULL AND next_attempt_at IS NULL \
           AND created_at < $1",
    )
    .bind(current)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    floor.set(Some(new));
    tracing::info!(floor = %new, was = %current, due, "outbox relay lowered its claim floor: rows below it became claimable");
    Ok(())
}

/// The claim floor an instance would work out now (see the module's docs), with the clock
/// margin `margin`: `None` on an unpartitioned outbox, or while a transaction that ran when
/// it was called still runs after `wait`. For the tests of the floor, and for
/// `Relay::publish_pending`, which drains with the floor of its start.
#[doc(hidden)]
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // a test hook too
pub async fn claim_floor(
    pool: &PgPool,
    margin: Duration,
    wait: Duration,
) -> Result<Option<DateTime<Utc>>> {
    let floor = Floor::default();
    let mut sightings = VecDeque::new();
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let partitioned = compute(pool, &floor, margin, &mut sightings).await?;
        if !partitioned || floor.get().is_some() || tokio::time::Instant::now() >= deadline {
            return Ok(floor.get());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
