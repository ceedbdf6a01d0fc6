//! The processors' claim, in each partition key's order (`seq`, the order the consumers
//! received the rows in; see `..._021_inbox_order.sql`). Two statements, at READ COMMITTED:
//!
//! 1. The claim: due rows, oldest first, leaving out the keys with a row waiting for its
//!    retry (the small index of retrying rows, read once), of a key only if the transaction
//!    gets the key's transaction-scoped advisory lock (`pg_try_advisory_xact_lock`: a key
//!    another processor holds is left to it, never waited for), locked, skipping rows locked
//!    elsewhere: the old unordered claim, plus a lock per key.
//! 2. The check, a statement that begins after the locks, so it sees whatever each key's
//!    previous holder committed: whether each key's rows claimed are its head (as many
//!    unprocessed, live rows up to the last one claimed as were claimed). The claim's snapshot
//!    began before some of its locks: a row its key's previous holder had just failed, or
//!    rows passed over while the key was still another's, make a key's claim not its head,
//!    and its rows are left for a later claim.
//!
//! So a key's rows are handled one batch at a time, in order, across every processor and
//! instance; a row waiting for its retry holds back the later rows of its key alone; a dead
//! row holds back nothing. Rows without a key are in no order and need no lock. Neither
//! statement walks a key's backlog: the check counts the rows claimed. Both start at the
//! processors' floor (`inbox/floor.rs`), not at the bottom of their indexes, where processed
//! rows leave entries until a vacuum.

use std::collections::HashSet;

use sqlx::Row as _;
use uuid::Uuid;

use super::Claimed;
use crate::error::Result;

/// First key of the advisory locks on partition keys ("INKY").
const KEY_LOCK: i32 = 0x494E_4B59;

/// Whether row `$t` is due: not processed, not dead, no retry pending.
macro_rules! due {
    ($t:literal) => {
        concat!(
            "NOT ",
            $t,
            ".processed AND ",
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

/// Whether row `$t`'s key has no row waiting for its retry (`ix_inbox_event_key_retrying`,
/// which holds failed rows alone: the set of such keys, read once per statement). A key's rows
/// are attempted in order, so its rows before one waiting for a retry are all processed or
/// dead: the key's row waiting holds back exactly its later ones.
macro_rules! not_held_back {
    ($t:literal) => {
        concat!(
            "(",
            $t,
            ".partition_key IS NULL OR (",
            $t,
            ".topic, ",
            $t,
            ".partition_key) NOT IN \
                 (SELECT p.topic, p.partition_key FROM inbox_event p \
                  WHERE p.next_attempt_at > now() AND NOT p.processed AND p.dead_at IS NULL \
                    AND p.partition_key IS NOT NULL))"
        )
    };
}

/// The claim: due rows, oldest first, not held back, up to `$1`, among the first `$2`
/// unprocessed, live ones (so a processor whose keys others hold stops there rather than read
/// the whole backlog), from the floor `$4` (see `inbox/floor.rs`: no row below it is due),
/// in the partitions received into so far (the ones made ahead left out at the executor's
/// start; the hour is a margin for a clock set back, as the receipt's); of a row with a key,
/// only if this transaction holds the key's advisory lock or gets it now (first key `$3`, the
/// second a hash of the schema, topic and key, so two schemas' inboxes in one database do not
/// contend); locked, skipping rows locked elsewhere. `$filter` narrows the rows.
macro_rules! claim_sql {
    ($filter:literal) => {
        concat!(
            "SELECT e.event_id, e.topic, e.event_type, e.payload::text AS payload, e.attempts, \
               e.partition_key, e.source_partition, e.source_offset, \
               NULLIF(e.headers, '{}')::text AS headers, e.schema_version, e.seq, e.received_at \
             FROM inbox_event e WHERE ",
            due!("e"),
            $filter,
            " AND e.seq >= $4 AND e.received_at <= statement_timestamp() + interval '1 hour' \
               AND e.seq <= (SELECT max(w.seq) FROM (SELECT seq FROM inbox_event \
                   WHERE NOT processed AND dead_at IS NULL AND seq >= $4 \
                     AND received_at <= statement_timestamp() + interval '1 hour' \
                   ORDER BY seq LIMIT $2) w) \
               AND (e.partition_key IS NULL OR pg_try_advisory_xact_lock($3, \
                   hashtext(current_schema() || E'\\x1f' || e.topic || E'\\x1f' \
                            || e.partition_key))) \
               AND ",
            not_held_back!("e"),
            " ORDER BY e.seq LIMIT $1 FOR UPDATE OF e SKIP LOCKED"
        )
    };
}

const CLAIM_SQL: &str = claim_sql!("");

/// The claim among `$5` (ids) alone. A query of its own: an optional filter would spoil the
/// plan of the one above.
const CLAIM_IDS_SQL: &str = claim_sql!(" AND e.event_id = ANY($5)");

/// Of each key claimed (`$1` topics, `$2` keys) up to its last row claimed (`$3` seq), from
/// the floor (`$4`), how many unprocessed, live rows there are (in the partitions received
/// into so far, as the claim: the ones made ahead are not probed per key), seen by a statement
/// that begins after the key's lock was taken: as many as were claimed if, and only if, the
/// claim is the key's head.
const HEADS_SQL: &str = "SELECT (SELECT count(*) FROM inbox_event p \
         WHERE p.topic = k.topic AND p.partition_key = k.partition_key \
           AND NOT p.processed AND p.dead_at IS NULL AND p.seq >= $4 AND p.seq <= k.last \
           AND p.received_at <= statement_timestamp() + interval '1 hour') \
     FROM unnest($1::text[], $2::text[], $3::int8[]) WITH ORDINALITY AS k(topic, partition_key, last, n) \
     ORDER BY k.n";

/// Window of the claim, in batches: how far past the oldest row a processor looks for keys
/// no other processor holds.
const WINDOW_FACTOR: usize = 4;

/// A claim's statement (`CLAIM_SQL` or one with its parameters) with its first four bound.
fn claim_query(
    sql: &str,
    limit: usize,
    floor: i64,
) -> sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(limit as i64)
        .bind((limit * WINDOW_FACTOR) as i64)
        .bind(KEY_LOCK)
        .bind(floor)
}

/// Claims up to `limit` due rows in their keys' order (see the module's docs), in `conn`'s
/// transaction, which must be at READ COMMITTED (the second statement then sees what the
/// previous holder of a key committed); `only`: of these ids alone. Rows come in the order to
/// handle them.
pub(crate) async fn claim(
    conn: &mut sqlx::PgConnection,
    limit: usize,
    only: Option<&[Uuid]>,
    floor: i64,
) -> Result<Vec<Claimed>> {
    let rows = match only {
        None => claim_query(CLAIM_SQL, limit, floor),
        Some(only) => claim_query(CLAIM_IDS_SQL, limit, floor).bind(only),
    }
    .fetch_all(&mut *conn)
    .await?;
    let mut claimed: Vec<Claimed> = Vec::with_capacity(rows.len());
    for row in &rows {
        claimed.push(super::claimed(row)?);
    }
    let keys = keys(&rows)?;
    if keys.is_empty() {
        return Ok(claimed);
    }
    let (topics, names, lasts) = heads_args(&keys);
    let counts: Vec<i64> = sqlx::query_scalar(HEADS_SQL)
        .bind(&topics)
        .bind(&names)
        .bind(&lasts)
        .bind(floor)
        .fetch_all(&mut *conn)
        .await?;
    let behind: HashSet<&(String, String)> = keys
        .iter()
        .zip(&counts)
        .filter(|((_, n, _), count)| *count != n)
        .map(|((key, _, _), _)| key)
        .collect();
    if behind.is_empty() {
        return Ok(claimed);
    }
    // A key whose claim is not its head (an earlier row another processor just failed, or
    // one skipped while the key was still another's): its rows wait for a later claim.
    Ok(claimed
        .into_iter()
        .filter(|c| {
            c.partition_key
                .as_ref()
                .is_none_or(|k| !behind.contains(&(c.topic.clone(), k.clone())))
        })
        .collect())
}

/// Each key's rows claimed and last seq, in the order of their first row.
type Keys = Vec<((String, String), i64, i64)>;

fn keys(rows: &[sqlx::postgres::PgRow]) -> Result<Keys> {
    let mut keys: Keys = Vec::new();
    for row in rows {
        let Some(k) = row.try_get::<Option<String>, _>("partition_key")? else {
            continue;
        };
        let topic: String = row.try_get("topic")?;
        let seq: i64 = row.try_get("seq")?;
        match keys
            .iter_mut()
            .find(|(key, _, _)| key.0 == topic && key.1 == k)
        {
            Some((_, n, last)) => {
                *n += 1;
                *last = seq;
            }
            None => keys.push(((topic, k), 1, seq)),
        }
    }
    Ok(keys)
}

/// [`HEADS_SQL`]'s arrays: the keys' topics, names and last seqs.
fn heads_args(keys: &Keys) -> (Vec<&str>, Vec<&str>, Vec<i64>) {
    (
        keys.iter().map(|((t, _), _, _)| t.as_str()).collect(),
        keys.iter().map(|((_, k), _, _)| k.as_str()).collect(),
        keys.iter().map(|(_, _, last)| *last).collect(),
    )
}

/// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` of a claim of `limit` as a processor makes it,
/// and of its head check, in a transaction rolled back.
#[cfg(feature = "testing")]
pub(crate) async fn explain(
    pool: &sqlx::PgPool,
    limit: usize,
    floor: i64,
) -> Result<Vec<serde_json::Value>> {
    let mut tx = crate::store::source_lock::begin(pool).await?;
    let rows = claim_query(CLAIM_SQL, limit, floor)
        .fetch_all(&mut *tx)
        .await?;
    let keys = keys(&rows)?;
    let (topics, names, lasts) = heads_args(&keys);
    let explain = format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {CLAIM_SQL}");
    let claim: serde_json::Value = sqlx::Row::try_get(
        &claim_query(&explain, limit, floor)
            .fetch_one(&mut *tx)
            .await?,
        0,
    )?;
    let heads: serde_json::Value = sqlx::query_scalar(&format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {HEADS_SQL}"
    ))
    .bind(&topics)
    .bind(&names)
    .bind(&lasts)
    .bind(floor)
    .fetch_one(&mut *tx)
    .await?;
    tx.rollback().await?;
    Ok(vec![claim, heads])
}
