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
//! What can still make a row below the floor claimable is an operator's or retention's doing
//! (a parked row retried, a partition attached back) or a write that bypasses `outbox_emit`
//! with an older `created_at`. Each computation finds those, makes them due (the claim takes a
//! due row below its cursor) and lowers the floor, so they wait at most one interval.

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
    loop {
        if let Err(e) = compute(&pool, &floor, margin, &mut sightings).await {
            tracing::debug!(error = %crate::error_chain(&e), "outbox relay could not compute its claim floor");
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
    if sightings.len() < MAX_SIGHTINGS {
        // The time first: a transaction that began before it runs still, or has ended.
        let at: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&mut *conn)
            .await?;
        let (virtual_xids, prepared): (Vec<String>, Vec<String>) = sqlx::query_as(
            "SELECT ARRAY(SELECT l.virtualxid FROM pg_locks l \
                          JOIN pg_stat_activity a ON a.pid = l.pid \
                          WHERE l.locktype = 'virtualxid' AND l.granted \
                            AND l.mode = 'ExclusiveLock' AND l.pid <> pg_backend_pid() \
                            AND a.datname = current_database()), \
                    ARRAY(SELECT gid FROM pg_prepared_xacts \
                          WHERE database = current_database())",
        )
        .fetch_one(&mut *conn)
        .await?;
        sightings.push_back(Sighting {
            at,
            virtual_xids,
            prepared,
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
                                  AND (gid = ANY($2) OR prepared >= $3))",
        )
        .bind(&s.virtual_xids)
        .bind(&s.prepared)
        .bind(s.at)
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
    let oldest: Option<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT min(created_at) FROM outbox_event \
         WHERE published_at IS NULL AND parked_at IS NULL AND created_at < $1",
    )
    .bind(before)
    .fetch_one(&mut *conn)
    .await?;
    let new = oldest.map_or(before, |o| o.min(before));
    if let Some(old) = floor.get().filter(|old| new < *old) {
        // Rows below the floor became claimable since (a parked row retried, a partition
        // attached back): due now, so that a claim takes them below its cursor too.
        let due = sqlx::query(
            "UPDATE outbox_event SET next_attempt_at = now() \
             WHERE published_at IS NULL AND parked_at IS NULL AND next_attempt_at IS NULL \
               AND created_at < $1",
        )
        .bind(old)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        tracing::info!(floor = %new, was = %old, due, "outbox relay lowered its claim floor: rows below it became claimable");
    }
    floor.set(Some(new));
    Ok(true)
}

/// The claim floor an instance would work out now (see the module's docs), with the clock
/// margin `margin`: `None` on an unpartitioned outbox, or while a transaction that ran when
/// it was called still runs after `wait`. For the tests of the floor, and for
/// `Relay::publish_pending`, which drains with the floor of its start.
#[doc(hidden)]
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
