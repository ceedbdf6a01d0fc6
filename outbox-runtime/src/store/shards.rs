//! Shards owned through session advisory locks, by the relay instances (of `outbox_event`) and
//! by the inbox processors (of `inbox_event`): keys are spread over [`SHARDS`] shards by a hash,
//! each shard is held by one member at a time, so one key's rows are worked on by one member
//! at a time, in order. A lock held by a session is released with it: a member whose session
//! ends (a crash, a network cut, `pg_terminate_backend`) gives its shards up at once, with
//! any transaction it had open, and the others take them at their next rebalance.
//!
//! Both kinds of member take their locks under their table's oid (the first key of the
//! two-key advisory locks), so installations in two schemas of one database, and the relay and
//! the processors of one, never count or block each other.

use std::collections::BTreeSet;
use std::time::Duration;

use sqlx::PgConnection;

use crate::error::Result;

/// Keys are spread over this many shards (`hashtext(...) & 63`).
pub(crate) const SHARDS: i32 = 64;

/// Second keys of the two-key advisory locks: a member slot is `MEMBER_KEY + slot`, a shard
/// `SHARD_KEY + shard`.
pub(crate) const MEMBER_KEY: i32 = 0x4d00_0000; // "M"
pub(crate) const SHARD_KEY: i32 = 0x5300_0000; // "S"
pub(crate) const MEMBER_SLOTS: i32 = 4096;

/// How often a busy member looks at its share of the shards (an idle one looks each time it
/// wakes).
pub(crate) const REBALANCE_EVERY: Duration = Duration::from_millis(100);

/// Whose locks: a table's, under its oid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Space {
    /// The table's oid, as the first key of the locks (an `oid` is unsigned: its bits, read as
    /// an `int4`).
    lock_space: i32,
}

impl Space {
    /// The space of the table whose oid is `oid`.
    pub(crate) fn of(oid: i64) -> Space {
        Space {
            lock_space: oid as u32 as i32,
        }
    }
}

/// `pg_locks` rows of `table`'s member locks (`l` is `pg_locks`; `$1` is [`MEMBER_KEY`], `$2`
/// [`MEMBER_SLOTS`]).
pub(crate) fn member_locks_sql(table: &str) -> String {
    format!(
        "l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
         AND l.classid = to_regclass('{table}')::oid \
         AND l.objid::int8 BETWEEN $1 AND $1 + $2 - 1 \
         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
}

/// Takes a member slot (a session advisory lock held while the member lives), so that every
/// member can count the live ones. Returns the slot.
pub(crate) async fn join(conn: &mut PgConnection, space: Space) -> Result<Option<i32>> {
    let slot: Option<i32> = sqlx::query_scalar(
        "SELECT s FROM generate_series(0, $3 - 1) AS s \
         WHERE pg_try_advisory_lock($1, $2 + s) LIMIT 1",
    )
    .bind(space.lock_space)
    .bind(MEMBER_KEY)
    .bind(MEMBER_SLOTS)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(slot)
}

/// Live members of `table` (the one on the `search_path`): the member locks held.
pub(crate) async fn members(conn: &mut PgConnection, table: &str) -> Result<i64> {
    let n: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM pg_locks l WHERE {}",
        member_locks_sql(table)
    ))
    .bind(i64::from(MEMBER_KEY))
    .bind(MEMBER_SLOTS)
    .fetch_one(&mut *conn)
    .await?;
    Ok(n)
}

/// Moves `owned` toward this member's fair share of the shards: releases extras, takes free
/// ones. Call it with no transaction of the member in flight: a shard released is another's at
/// once. Returns whether it took shards, and the live members counted.
pub(crate) async fn rebalance(
    conn: &mut PgConnection,
    space: Space,
    table: &str,
    owned: &mut BTreeSet<i32>,
    slot: i32,
) -> Result<(bool, i64)> {
    let members = members(conn, table).await?.max(1);
    let target = ((SHARDS as i64 + members - 1) / members) as usize;
    let unlock = "SELECT pg_advisory_unlock($1, $2 + s) FROM unnest($3::int4[]) AS s";
    if owned.len() > target {
        let extra: Vec<i32> = owned
            .iter()
            .rev()
            .take(owned.len() - target)
            .copied()
            .collect();
        sqlx::query(unlock)
            .bind(space.lock_space)
            .bind(SHARD_KEY)
            .bind(&extra)
            .execute(&mut *conn)
            .await?;
        for s in extra {
            owned.remove(&s);
        }
        return Ok((false, members));
    }
    if owned.len() == target {
        return Ok((false, members));
    }
    // Start from a place that depends on the slot, so members try different shards.
    let start = (slot * 17).rem_euclid(SHARDS);
    let candidates: Vec<i32> = (0..SHARDS)
        .map(|i| (start + i) % SHARDS)
        .filter(|s| !owned.contains(s))
        .collect();
    let got: Vec<i32> = sqlx::query_scalar(
        "SELECT s FROM unnest($3::int4[]) AS s WHERE pg_try_advisory_lock($1, $2 + s)",
    )
    .bind(space.lock_space)
    .bind(SHARD_KEY)
    .bind(&candidates)
    .fetch_all(&mut *conn)
    .await?;
    let need = target - owned.len();
    let (keep, give_back) = got.split_at(got.len().min(need));
    owned.extend(keep);
    if !give_back.is_empty() {
        sqlx::query(unlock)
            .bind(space.lock_space)
            .bind(SHARD_KEY)
            .bind(give_back)
            .execute(&mut *conn)
            .await?;
    }
    Ok((!keep.is_empty(), members))
}

/// The shards as a bit mask (bit `s` for shard `s`), which a claim tests in constant time.
pub(crate) fn shard_mask(shards: &BTreeSet<i32>) -> i64 {
    shards.iter().fold(0u64, |m, s| m | 1 << s) as i64
}
