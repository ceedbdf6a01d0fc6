//! Shards owned through session advisory locks, by the relay instances (of `outbox_event`) and
//! by the inbox processors (of `inbox_event`): keys are spread over [`SHARDS`] shards by a hash,
//! each shard is held by one member at a time, so one key's rows are worked on by one member
//! at a time, in order. A lock held by a session is released with it: a member whose session
//! ends (a crash, a network cut, `pg_terminate_backend`) gives its shards up at once, with
//! any transaction it had open, and the others take them at their next rebalance.
//!
//! The two kinds of member take their locks under different first keys and second keys
//! ([`Kind`]), so installations in two schemas of one database, and the relay and the
//! processors of one, never count or block each other. A relay's first key is its table's oid
//! (converting `outbox_event` to partitions is refused while relays run); the processors' is
//! the oid of their table's schema, which converting `inbox_event` to partitions (a new table,
//! a new oid, while consumers run) leaves as it is: processors started before a conversion and
//! after it share one set of shards.

use std::collections::BTreeSet;
use std::time::Duration;

use sqlx::PgConnection;

use crate::error::{Error, Result};

/// Keys are spread over this many shards (`hashtext(...) & 63`).
pub(crate) const SHARDS: i32 = 64;

/// Member slots of a kind: a member's slot is one of `0..MEMBER_SLOTS`.
pub(crate) const MEMBER_SLOTS: i32 = 4096;

/// How often a busy member looks at its share of the shards (an idle one looks each time it
/// wakes).
pub(crate) const REBALANCE_EVERY: Duration = Duration::from_millis(100);

/// Whose shards: the relay instances of the `outbox_event` on the `search_path`, or the
/// processors of its `inbox_event`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Relay,
    Inbox,
}

impl Kind {
    /// Second key of a member slot's lock: this plus the slot.
    pub(crate) fn member_key(self) -> i32 {
        match self {
            Kind::Relay => 0x4d00_0000, // "M"
            Kind::Inbox => 0x6d00_0000, // "m"
        }
    }

    /// Second key of a shard's lock: this plus the shard.
    pub(crate) fn shard_key(self) -> i32 {
        match self {
            Kind::Relay => 0x5300_0000, // "S"
            Kind::Inbox => 0x7300_0000, // "s"
        }
    }

    /// The table, by the name `search_path` resolves.
    fn table(self) -> &'static str {
        match self {
            Kind::Relay => "outbox_event",
            Kind::Inbox => "inbox_event",
        }
    }

    /// The first key of the locks (an `oid`), as SQL: NULL without the table.
    fn first_key_sql(self) -> &'static str {
        match self {
            Kind::Relay => "to_regclass('outbox_event')::oid",
            Kind::Inbox => {
                "(SELECT relnamespace FROM pg_class WHERE oid = to_regclass('inbox_event'))"
            }
        }
    }
}

/// Whose locks, under which first key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Space {
    kind: Kind,
    /// The first key of the locks (an `oid` is unsigned: its bits, read as an `int4`).
    lock_space: i32,
}

impl Space {
    /// The relay's space of the outbox table whose oid is `oid`.
    pub(crate) fn relay(oid: i64) -> Space {
        Space::new(Kind::Relay, oid)
    }

    /// The space of `kind` under the first key `oid`.
    fn new(kind: Kind, oid: i64) -> Space {
        Space {
            kind,
            lock_space: oid as u32 as i32,
        }
    }

    /// The space of `kind` in the database `conn` is on, for the table its `search_path`
    /// resolves. A clear error without the table.
    pub(crate) async fn resolve(conn: &mut PgConnection, kind: Kind) -> Result<Space> {
        let oid: Option<i64> =
            sqlx::query_scalar(&format!("SELECT ({})::int8", kind.first_key_sql()))
                .fetch_one(&mut *conn)
                .await?;
        let oid = oid.ok_or_else(|| {
            Error::Config(format!(
                "no {} table on the search_path: run the migrations (`outbox migrate`)",
                kind.table()
            ))
        })?;
        Ok(Space::new(kind, oid))
    }
}

/// `pg_locks` rows of the member locks of `kind` (`l` is `pg_locks`; `$1` is the kind's
/// [`Kind::member_key`], `$2` [`MEMBER_SLOTS`]).
pub(crate) fn member_locks_sql(kind: Kind) -> String {
    format!(
        "l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
         AND l.classid = {} \
         AND l.objid::int8 BETWEEN $1 AND $1 + $2 - 1 \
         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        kind.first_key_sql()
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
    .bind(space.kind.member_key())
    .bind(MEMBER_SLOTS)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(slot)
}

/// Live members of `kind` (of its table on the `search_path`): the member locks held.
pub(crate) async fn members(conn: &mut PgConnection, kind: Kind) -> Result<i64> {
    let n: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM pg_locks l WHERE {}",
        member_locks_sql(kind)
    ))
    .bind(i64::from(kind.member_key()))
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
    owned: &mut BTreeSet<i32>,
    slot: i32,
) -> Result<(bool, i64)> {
    let members = members(conn, space.kind).await?;
    match Plan::new(owned, members, slot) {
        Plan::Keep => Ok((false, members.max(1))),
        Plan::Release(extra) => {
            unlock(conn, space, &extra).await?;
            for s in extra {
                owned.remove(&s);
            }
            Ok((false, members.max(1)))
        }
        Plan::Take { candidates, need } => {
            let got = try_lock(conn, space, &candidates).await?;
            let (keep, give_back) = got.split_at(got.len().min(need));
            owned.extend(keep);
            if !give_back.is_empty() {
                unlock(conn, space, give_back).await?;
            }
            Ok((!keep.is_empty(), members.max(1)))
        }
    }
}

/// What a member does to move toward its fair share of the shards, whatever holds the locks
/// (PostgreSQL's advisory locks, MySQL's named locks).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// It holds its share.
    Keep,
    /// It holds more: these go (the highest first).
    Release(Vec<i32>),
    /// It holds less: try these, in this order (from a place that depends on its slot, so
    /// that members try different shards), and keep `need` of those it gets.
    Take { candidates: Vec<i32>, need: usize },
}

impl Plan {
    /// The plan of a member in `slot` holding `owned` among `members` live ones.
    pub(crate) fn new(owned: &BTreeSet<i32>, members: i64, slot: i32) -> Plan {
        let members = members.max(1);
        let target = ((SHARDS as i64 + members - 1) / members) as usize;
        if owned.len() > target {
            return Plan::Release(
                owned
                    .iter()
                    .rev()
                    .take(owned.len() - target)
                    .copied()
                    .collect(),
            );
        }
        if owned.len() == target {
            return Plan::Keep;
        }
        let start = (slot * 17).rem_euclid(SHARDS);
        Plan::Take {
            candidates: (0..SHARDS)
                .map(|i| (start + i) % SHARDS)
                .filter(|s| !owned.contains(s))
                .collect(),
            need: target - owned.len(),
        }
    }
}

/// Takes every shard no member holds, beside `owned`. Returns whether it took any.
pub(crate) async fn take_free(
    conn: &mut PgConnection,
    space: Space,
    owned: &mut BTreeSet<i32>,
) -> Result<bool> {
    let candidates: Vec<i32> = (0..SHARDS).filter(|s| !owned.contains(s)).collect();
    let got = try_lock(conn, space, &candidates).await?;
    owned.extend(&got);
    Ok(!got.is_empty())
}

/// Locks those of `shards` no one holds; returns them.
async fn try_lock(conn: &mut PgConnection, space: Space, shards: &[i32]) -> Result<Vec<i32>> {
    Ok(sqlx::query_scalar(
        "SELECT s FROM unnest($3::int4[]) AS s WHERE pg_try_advisory_lock($1, $2 + s)",
    )
    .bind(space.lock_space)
    .bind(space.kind.shard_key())
    .bind(shards)
    .fetch_all(&mut *conn)
    .await?)
}

/// Releases `shards`.
async fn unlock(conn: &mut PgConnection, space: Space, shards: &[i32]) -> Result<()> {
    sqlx::query("SELECT pg_advisory_unlock($1, $2 + s) FROM unnest($3::int4[]) AS s")
        .bind(space.lock_space)
        .bind(space.kind.shard_key())
        .bind(shards)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// The shards as a bit mask (bit `s` for shard `s`), which a claim tests in constant time.
pub(crate) fn shard_mask(shards: &BTreeSet<i32>) -> i64 {
    shards.iter().fold(0u64, |m, s| m | 1 << s) as i64
}
