//! The processors' claim, in each partition key's order (`seq`, the order the consumers
//! received the rows in; see `..._021_inbox_order.sql`).
//!
//! A processor reads a window of due rows, oldest first, leaving out those an earlier row of
//! their key waiting for its retry holds back, and locks nothing. It then takes a
//! transaction-scoped advisory lock on each key it wants (`pg_try_advisory_xact_lock`: a key
//! another processor holds is left to it, never waited for), in the window's order, until its
//! rows fill the batch. Holding a key's lock, it claims the rows (`FOR UPDATE SKIP LOCKED`)
//! in a statement that begins after the lock, so it sees whatever the key's previous holder
//! committed, and that leaves out any row with an earlier unprocessed, live row of its key
//! outside the batch; of each key, only the rows before the first one it could not claim are
//! kept. So a key's rows are handled one batch at a time, in order, across every processor
//! and instance; a row waiting for its retry holds back the later rows of its key alone; a
//! dead row holds back nothing. Rows without a key are in no order, and need no lock.

use std::collections::{HashMap, HashSet};

use sqlx::Row as _;
use uuid::Uuid;

use super::Claimed;
use crate::error::Result;

/// First key of the advisory locks on partition keys ("INKY").
const KEY_LOCK: i32 = 0x494E_4B59;

/// How much larger than the batch the window is: room to find keys no other processor holds.
const WINDOW_FACTOR: usize = 2;

/// Rounds of key locks per claim at most.
const LOCK_ROUNDS: usize = 4;

/// Whether a row is due: not processed, not dead, no retry pending.
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

/// The window: due rows, oldest first, that no earlier row of their key waiting for its retry
/// holds back (rows of a key stuck behind one are not worth reading again and again).
macro_rules! window_sql {
    ($filter:literal) => {
        concat!(
            "SELECT event_id, topic, partition_key FROM inbox_event e WHERE ",
            due!("e"),
            $filter,
            " AND (e.partition_key IS NULL OR NOT EXISTS (SELECT 1 FROM inbox_event p \
                 WHERE p.topic = e.topic AND p.partition_key = e.partition_key \
                   AND NOT p.processed AND p.dead_at IS NULL AND p.seq < e.seq \
                   AND p.next_attempt_at > now())) \
             ORDER BY e.seq LIMIT $1"
        )
    };
}

const WINDOW_SQL: &str = window_sql!("");

/// The window among `$2` (ids) alone. A query of its own: an optional filter would spoil the
/// plan of the one above.
const WINDOW_IDS_SQL: &str = window_sql!(" AND e.event_id = ANY($2)");

/// Rows `$1` (ids), locked, of which a row with an earlier unprocessed, live row of its key
/// outside `$1` is left out.
const CLAIM_SQL: &str = concat!(
    "SELECT event_id, topic, event_type, payload::text AS payload, attempts, partition_key, \
       source_partition, source_offset, NULLIF(headers, '{}')::text AS headers, schema_version \
     FROM inbox_event e WHERE e.event_id = ANY($1) AND ",
    due!("e"),
    " AND (e.partition_key IS NULL OR NOT EXISTS (SELECT 1 FROM inbox_event p \
         WHERE p.topic = e.topic AND p.partition_key = e.partition_key \
           AND NOT p.processed AND p.dead_at IS NULL AND p.seq < e.seq \
           AND p.event_id <> ALL($1))) \
     ORDER BY e.seq FOR UPDATE SKIP LOCKED"
);

/// A row of the window.
struct Candidate {
    event_id: Uuid,
    /// Its topic and partition key; `None`: no key, no order.
    key: Option<(String, String)>,
}

/// Claims up to `limit` due rows in their keys' order (see the module's docs), in `conn`'s
/// transaction, which must be at READ COMMITTED (each statement then sees what the previous
/// holder of a key committed); `only`: of these ids alone. Rows come in the order to handle
/// them.
pub(crate) async fn claim(
    conn: &mut sqlx::PgConnection,
    limit: usize,
    only: Option<&[Uuid]>,
) -> Result<Vec<Claimed>> {
    let window = window(conn, limit, only).await?;
    let chosen = choose(conn, &window, limit).await?;
    if chosen.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<Uuid> = chosen.iter().map(|c| c.event_id).collect();
    let rows = sqlx::query(CLAIM_SQL)
        .bind(&ids)
        .fetch_all(&mut *conn)
        .await?;
    let mut claimed: HashMap<Uuid, Claimed> = HashMap::with_capacity(rows.len());
    for row in &rows {
        let c = super::claimed(row)?;
        claimed.insert(c.event_id, c);
    }
    Ok(in_key_order(&chosen, claimed))
}

/// Of the rows chosen (in order), those claimed, each key's cut at its first row not
/// claimed (processed meanwhile, failed by the key's previous holder, locked by a tool).
fn in_key_order(chosen: &[&Candidate], mut claimed: HashMap<Uuid, Claimed>) -> Vec<Claimed> {
    let mut broken: HashSet<&(String, String)> = HashSet::new();
    let mut out = Vec::with_capacity(claimed.len());
    for candidate in chosen {
        let key = candidate.key.as_ref();
        if key.is_some_and(|k| broken.contains(k)) {
            continue;
        }
        match claimed.remove(&candidate.event_id) {
            Some(row) => out.push(row),
            None => {
                if let Some(k) = key {
                    broken.insert(k);
                }
            }
        }
    }
    out
}

async fn window(
    conn: &mut sqlx::PgConnection,
    limit: usize,
    only: Option<&[Uuid]>,
) -> Result<Vec<Candidate>> {
    let size = (limit * WINDOW_FACTOR) as i64;
    let rows = match only {
        None => sqlx::query(WINDOW_SQL).bind(size),
        Some(ids) => sqlx::query(WINDOW_IDS_SQL).bind(size).bind(ids),
    }
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| {
            let topic: String = r.try_get("topic")?;
            let key: Option<String> = r.try_get("partition_key")?;
            Ok(Candidate {
                event_id: r.try_get("event_id")?,
                key: key.map(|k| (topic, k)),
            })
        })
        .collect()
}

/// The window's rows to claim, in order: up to `limit`, of keys this transaction got the
/// lock of (asked for in the window's order, in a few rounds, each for the keys that would
/// fill what is left of the batch) and without a key.
async fn choose<'w>(
    conn: &mut sqlx::PgConnection,
    window: &'w [Candidate],
    limit: usize,
) -> Result<Vec<&'w Candidate>> {
    let mut held: HashMap<&(String, String), bool> = HashMap::new();
    let mut chosen: Vec<&Candidate> = Vec::with_capacity(limit);
    let mut from = 0;
    for _ in 0..LOCK_ROUNDS {
        if from >= window.len() || chosen.len() >= limit {
            break;
        }
        // The keys not asked for yet that the next rows would bring in, to fill the batch.
        let mut ask: Vec<&(String, String)> = Vec::new();
        let mut projected = chosen.len();
        let mut to = from;
        while to < window.len() && projected < limit {
            match window[to].key.as_ref() {
                None => projected += 1,
                Some(k) => match held.get(k) {
                    Some(true) => projected += 1,
                    Some(false) => {}
                    None => {
                        if !ask.contains(&k) {
                            ask.push(k);
                        }
                        projected += 1;
                    }
                },
            }
            to += 1;
        }
        if !ask.is_empty() {
            let got = try_lock(conn, &ask).await?;
            held.extend(ask.into_iter().zip(got));
        }
        for candidate in &window[from..to] {
            if chosen.len() >= limit {
                break;
            }
            if candidate.key.as_ref().is_none_or(|k| held[k]) {
                chosen.push(candidate);
            }
        }
        from = to;
    }
    Ok(chosen)
}

/// Tries the advisory lock of each key (under the schema too, so that two schemas' inboxes
/// in one database do not contend): whether it got each, in order.
async fn try_lock(conn: &mut sqlx::PgConnection, keys: &[&(String, String)]) -> Result<Vec<bool>> {
    let topics: Vec<&str> = keys.iter().map(|(t, _)| t.as_str()).collect();
    let names: Vec<&str> = keys.iter().map(|(_, k)| k.as_str()).collect();
    Ok(sqlx::query_scalar(
        "SELECT pg_try_advisory_xact_lock($1, \
             hashtext(current_schema() || E'\\x1f' || u.t || E'\\x1f' || u.k)) \
         FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS u(t, k, n) ORDER BY u.n",
    )
    .bind(KEY_LOCK)
    .bind(&topics)
    .bind(&names)
    .fetch_all(conn)
    .await?)
}
