//! The processors' claim, in each partition key's order (`seq`, the order the consumers
//! received the rows in; see `..._021_inbox_order.sql`), one statement at READ COMMITTED: due
//! rows, oldest first, of a key only if the key's shard is this processor's (the shards are
//! held through session locks, `inbox/shards.rs`) or of no key, leaving out the keys with a
//! row waiting for its retry (the small index of retrying rows, read once), locked, skipping
//! rows locked elsewhere (rows of no key, which any processor takes).
//!
//! So a key's rows are handled by one processor at a time, across every instance, and in
//! order: its shard's holder takes it only between its batches, on the connection its
//! batches run on, so the holder before it has committed or rolled back all it did, and the
//! claim (whose snapshot begins after the shard was taken) sees it: a retry recorded, rows
//! processed. A row waiting for its retry holds back the later rows of its key alone; a dead
//! row holds back nothing. Rows without a key are in no order. The claim starts at the
//! processors' floor (`inbox/floor.rs`), not at the bottom of its index, where processed rows
//! leave entries until a vacuum, and reads a window from the first row of the processor's own
//! shards: a burst of one key holds back the rows of its processor's shards, and no others.

use uuid::Uuid;

use super::Claimed;
use crate::error::Result;

/// Whether row `$t` is due: not processed, not dead, no retry pending.
macro_rules! due {
    ($t:literal) => {
        concat!("NOT ", $t, ".processed AND ", not_dead_or_waiting!($t))
    };
}

/// Row `$t` is not dead, and no retry of it is pending.
macro_rules! not_dead_or_waiting {
    ($t:literal) => {
        concat!(
            $t,
            ".dead_at IS NULL \
             AND (",
            $t,
            ".next_attempt_at IS NULL OR ",
            $t,
            ".next_attempt_at <= now())"
        )
    };
}

/// The keys with a row waiting for its retry (`ix_inbox_event_key_retrying`, which holds
/// failed rows alone), read once per statement. A key's rows are attempted in order, so its
/// rows before one waiting for a retry are all processed or dead: the key's row waiting holds
/// back exactly its later ones. In that index's order, so that no plan reads another index
/// for them (the pending one, whose order it has no use for, would serve as well while a
/// partition is empty).
macro_rules! held {
    () => {
        "WITH held AS MATERIALIZED (SELECT p.topic, p.partition_key FROM inbox_event p \
         WHERE p.next_attempt_at > now() AND NOT p.processed AND p.dead_at IS NULL \
           AND p.partition_key IS NOT NULL ORDER BY p.topic, p.partition_key) "
    };
}

/// Whether row `$t`'s key is not `held!` back.
macro_rules! not_held_back {
    ($t:literal) => {
        concat!(
            "(",
            $t,
            ".partition_key IS NULL OR (",
            $t,
            ".topic, ",
            $t,
            ".partition_key) NOT IN (SELECT * FROM held))"
        )
    };
}

/// Whether row `$t`'s key is in a shard of the mask `$mask` (a parameter; bit `s` for shard
/// `s`, as `store/shards.rs` numbers them), or it has no key.
macro_rules! mine {
    ($t:literal, $mask:literal) => {
        concat!(
            "(",
            $t,
            ".partition_key IS NULL OR (",
            $mask,
            "::int8 >> (hashtext(",
            $t,
            ".topic || E'\\x1f' || ",
            $t,
            ".partition_key) & 63)) & 1 = 1)"
        )
    };
}

/// Whether row `$t` is one to claim by someone: due, not held back, from the floor `$4` (see
/// `inbox/floor.rs`: no row below it is due), in the partitions received into so far (the
/// ones made ahead left out at the executor's start; the hour is a margin for a clock set
/// back, as the receipt's).
macro_rules! claimable {
    ($t:literal) => {
        claimable_if!($t, due!($t))
    };
}

/// [`claimable!`] with `$due` as the test that row `$t` is due.
macro_rules! claimable_if {
    ($t:literal, $due:expr) => {
        concat!(
            $due,
            " AND ",
            not_held_back!($t),
            " AND ",
            $t,
            ".seq >= $4 AND ",
            $t,
            ".received_at <= statement_timestamp() + interval '1 hour'"
        )
    };
}

/// The claim: rows to claim, of this processor's shards (`$3`), oldest first, up to `$1`;
/// locked, skipping rows locked elsewhere. `$among` narrows the rows; `$with` adds to the
/// `WITH` list (after a comma) what it needs.
macro_rules! claim_sql {
    ($with:expr, $among:expr) => {
        concat!(
            held!(),
            $with,
            "SELECT e.event_id, e.topic, e.event_type, e.payload::text AS payload, e.attempts, \
               e.partition_key, e.source_partition, e.source_offset, \
               NULLIF(e.headers, '{}')::text AS headers, e.schema_version, e.received_at \
             FROM inbox_event e WHERE ",
            claimable!("e"),
            " AND ",
            mine!("e", "$3"),
            $among,
            " ORDER BY e.seq LIMIT $1 FOR UPDATE OF e SKIP LOCKED"
        )
    };
}

/// Row `$t`'s shard as `ix_inbox_event_shard_pending` holds it (`..._023_inbox_shard_pending.sql`,
/// the same expression, for the planner to match): its key's, as [`mine!`] computes it, and 64
/// for no key.
macro_rules! shard {
    ($t:literal) => {
        concat!(
            "coalesce(hashtext(",
            $t,
            ".topic || E'\\x1f' || ",
            $t,
            ".partition_key) & 63, 64)"
        )
    };
}

/// The first row to claim by this processor (its `seq`, in a CTE `start`): of its shards `$3`
/// or of no key, each shard's first found in its index, so that what other shards hold ahead
/// of it (a burst of one key, another processor's) is never walked.
macro_rules! start_mine {
    () => {
        concat!(
            ", start AS MATERIALIZED (SELECT (SELECT min(f.seq) \
               FROM generate_series(0, 64) AS s(n), \
               LATERAL (SELECT w.seq FROM inbox_event w WHERE ",
            shard!("w"),
            " = s.n AND ",
            // `processed IS NOT TRUE`, as that index's condition says (the migration says why).
            claimable_if!(
                "w",
                concat!("w.processed IS NOT TRUE AND ", not_dead_or_waiting!("w"))
            ),
            " ORDER BY w.seq LIMIT 1) f \
               WHERE s.n = 64 OR ($3::int8 >> s.n) & 1 = 1) AS seq) "
        )
    };
}

/// The first row to claim by anyone (its `seq`).
macro_rules! first_claimable {
    () => {
        concat!(
            "(SELECT w.seq FROM inbox_event w WHERE ",
            claimable!("w"),
            " ORDER BY w.seq LIMIT 1)"
        )
    };
}

/// The claim of a processor that holds every shard, among the rows from the first to claim
/// by anyone to `$2` later in `seq` (rows held back before it are stepped over once, not
/// counted).
const CLAIM_ALL_SQL: &str = claim_sql!(
    "",
    concat!(
        " AND e.seq BETWEEN ",
        first_claimable!(),
        " AND ",
        first_claimable!(),
        " + $2"
    )
);

/// The claim of a processor that holds some of the shards, among the rows from its own first
/// ([`start_mine!`]) to `$2` later in `seq`: so one whose shards have nothing near the front
/// stops there rather than read the whole backlog, and one whose shards have rows behind
/// another's burst reaches them at once.
const CLAIM_SQL: &str = claim_sql!(
    start_mine!(),
    " AND e.seq BETWEEN (SELECT seq FROM start) AND (SELECT seq FROM start) + $2"
);

/// The claim among `$2` (ids) alone. A query of its own: an optional filter would spoil the
/// plan of the ones above.
const CLAIM_IDS_SQL: &str = claim_sql!("", " AND e.event_id = ANY($2)");

/// A claim's statement of `limit` rows from `floor` of the `shards` (a mask), and `among`: of
/// the first `Window` rows to claim, or of the `Ids`.
fn claim_query<'q>(
    sql: &'q str,
    limit: usize,
    shards: i64,
    floor: i64,
    among: Among<'q>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let query = sqlx::query(sql).bind(limit as i64);
    let query = match among {
        Among::Window(window) => query.bind(window as i64),
        Among::Ids(ids) => query.bind(ids),
    };
    query.bind(shards).bind(floor)
}

/// What a claim's `$2` says.
enum Among<'q> {
    Window(usize),
    Ids(&'q [Uuid]),
}

/// Begins a processor's transaction, at READ COMMITTED whatever the role's default (its claim
/// then sees what the shards' previous holders committed), with the planner left only index
/// scans in their order for the claim. On statistics that say few rows are due (the last
/// analyze saw them all processed: before a burst, between autovacuum's rounds) it would read
/// the claim's whole window and sort it, several batches' reads for every claim until the
/// next analyze. The handlers get the session's own settings back ([`planner_restore`])
/// before they run.
pub(crate) const BEGIN_SQL: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; \
     SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; \
     SET LOCAL enable_sort = off";

/// The statement that gives a session its own planner settings back after a claim in a
/// transaction [`BEGIN_SQL`] began (read once per session; the settings are booleans).
pub(crate) async fn planner_restore(conn: &mut sqlx::PgConnection) -> Result<String> {
    let (seqscan, bitmapscan, sort): (String, String, String) = sqlx::query_as(
        "SELECT current_setting('enable_seqscan'), current_setting('enable_bitmapscan'), \
                current_setting('enable_sort')",
    )
    .fetch_one(&mut *conn)
    .await?;
    let on = |v: &str| if v == "off" { "off" } else { "on" };
    Ok(format!(
        "SET LOCAL enable_seqscan = {}; SET LOCAL enable_bitmapscan = {}; \
         SET LOCAL enable_sort = {}",
        on(&seqscan),
        on(&bitmapscan),
        on(&sort)
    ))
}

/// Which rows a processor claims.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scope {
    /// Its shards, as a mask (`store/shards.rs`).
    pub(crate) shards: i64,
    /// How many processors there are (the share of the rows it may find its own).
    pub(crate) members: i64,
    /// Where to start (`inbox/floor.rs`).
    pub(crate) floor: i64,
}

/// Claims up to `limit` due rows of `scope`'s shards in their keys' order (see the module's
/// docs), in `conn`'s transaction, which [`BEGIN_SQL`] began on the connection that holds
/// the shards, then gives the session its planner settings back (`restore`, from
/// [`planner_restore`]); `only`: of these ids alone. Rows come in the order to handle them.
pub(crate) async fn claim(
    conn: &mut sqlx::PgConnection,
    limit: usize,
    only: Option<&[Uuid]>,
    scope: Scope,
    restore: &str,
) -> Result<Vec<Claimed>> {
    let (sql, among) = match only {
        None => {
            // Holding every shard, its own first row is anyone's: one lookup, not 65.
            let sql = if scope.shards == -1 {
                CLAIM_ALL_SQL
            } else {
                CLAIM_SQL
            };
            (sql, Among::Window(window(limit, scope.members)))
        }
        Some(ids) => (CLAIM_IDS_SQL, Among::Ids(ids)),
    };
    let rows = claim_query(sql, limit, scope.shards, scope.floor, among)
        .fetch_all(&mut *conn)
        .await?;
    sqlx::Executor::execute(&mut *conn, restore).await?;
    rows.iter().map(super::claimed).collect()
}

/// The ids of up to `limit` (`$1`) due rows of the shards `$2` (a mask) or of no key, oldest
/// first, locking nothing: what a processor handles one by one after a refused commit.
pub(crate) async fn due_ids(
    conn: &mut sqlx::PgConnection,
    limit: usize,
    shards: i64,
) -> Result<Vec<Uuid>> {
    Ok(sqlx::query_scalar(concat!(
        "SELECT e.event_id FROM inbox_event e WHERE ",
        due!("e"),
        " AND ",
        mine!("e", "$2"),
        " ORDER BY e.seq LIMIT $1"
    ))
    .bind(limit as i64)
    .bind(shards)
    .fetch_all(conn)
    .await?)
}

/// How far past the first row to claim a claim of `limit` looks (in `seq`, so processed rows
/// count) with `members` processors: each one's share and three batches more.
fn window(limit: usize, members: i64) -> usize {
    limit.saturating_mul(usize::try_from(members.max(1)).unwrap_or(1) + 3)
}

/// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` of a claim of `limit` as the only processor
/// makes it (every shard its own), in a transaction rolled back.
#[cfg(feature = "testing")]
pub(crate) async fn explain(
    pool: &sqlx::PgPool,
    limit: usize,
    floor: i64,
) -> Result<serde_json::Value> {
    let mut tx = pool.begin_with(BEGIN_SQL).await?;
    let explain = format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {CLAIM_ALL_SQL}");
    let claim: serde_json::Value = sqlx::Row::try_get(
        &claim_query(&explain, limit, -1, floor, Among::Window(window(limit, 1)))
            .fetch_one(&mut *tx)
            .await?,
        0,
    )?;
    tx.rollback().await?;
    Ok(claim)
}
