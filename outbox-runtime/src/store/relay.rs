//! The relay's SQL: where the outbox lives, shard ownership, claiming, marking, failures.
//! Built without any broker, so that `admin` can count relay instances in builds without the
//! relay.

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};

use sqlx::{Executor, PgConnection, Row};

use super::record::{claimed_columns, Claimed};
use super::shards::{self, Kind, Space};
pub(crate) use super::shards::{shard_mask, SHARDS};
use crate::error::{Error, Result};

/// The `outbox_event` table that `search_path` resolves to, as the relay needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Table {
    /// The relay's member and shard locks, under the table's oid.
    space: Space,
    /// The oid of the sequence behind `outbox_event.id`.
    id_sequence: i64,
}

impl Table {
    /// Finds the table and its id sequence. Refuses a sequence with a cache: the claim's
    /// horizon needs ids handed out in the order they are drawn.
    pub(crate) async fn resolve(conn: &mut PgConnection) -> Result<Table> {
        let row: Option<(i64, i64, i64)> = sqlx::query_as(
            "SELECT t.oid::int8, s.seqrelid::int8, s.seqcache \
             FROM (SELECT to_regclass('outbox_event') AS oid) t \
             JOIN pg_sequence s ON s.seqrelid = pg_get_serial_sequence(t.oid::text, 'id')::regclass",
        )
        .fetch_optional(&mut *conn)
        .await?;
        let Some((table, id_sequence, cache)) = row else {
            return Err(Error::Config(
                "no outbox_event table on the search_path: run the migrations (`outbox migrate`)"
                    .into(),
            ));
        };
        if cache != 1 {
            return Err(Error::Config(format!(
                "the sequence of outbox_event.id has CACHE {cache}: the relay needs CACHE 1 \
                 (ids handed out in the order they are drawn; ALTER SEQUENCE ... CACHE 1)"
            )));
        }
        Ok(Table {
            space: Space::relay(table),
            id_sequence,
        })
    }
}

/// Takes a member slot: see [`shards::join`].
pub(crate) async fn join(conn: &mut PgConnection, table: Table) -> Result<Option<i32>> {
    shards::join(conn, table.space).await
}

/// Live relay instances of the outbox on the `search_path`: the member locks held.
pub(crate) async fn members(conn: &mut PgConnection) -> Result<i64> {
    shards::members(conn, Kind::Relay).await
}

/// One live relay instance as the database sees it: its session and the advisory locks it holds.
pub(crate) struct Member {
    pub(crate) pid: i32,
    pub(crate) slot: i32,
    pub(crate) shards: Vec<i32>,
    pub(crate) connected_at: Option<DateTime<Utc>>,
    pub(crate) application_name: Option<String>,
    pub(crate) client_addr: Option<String>,
}

/// The live relay instances of the outbox on the `search_path`, by member slot, with the shards
/// each holds (its shard locks) and its session's start, name and address.
pub(crate) async fn member_list(conn: &mut PgConnection) -> Result<Vec<Member>> {
    let rows = sqlx::query(&format!(
        "SELECT l.pid, (l.objid::int8 - $1)::int4 AS slot, \
                array(SELECT (s.objid::int8 - $3)::int4 FROM pg_locks s \
                      WHERE s.pid = l.pid AND s.locktype = 'advisory' AND s.granted \
                        AND s.objsubid = 2 AND s.classid = l.classid \
                        AND s.database = l.database \
                        AND s.objid::int8 BETWEEN $3 AND $3 + $4 - 1 \
                      ORDER BY 1) AS shards, \
                a.backend_start, a.application_name, host(a.client_addr) AS client_addr \
         FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE {} ORDER BY slot",
        shards::member_locks_sql(Kind::Relay)
    ))
    .bind(i64::from(Kind::Relay.member_key()))
    .bind(shards::MEMBER_SLOTS)
    .bind(i64::from(Kind::Relay.shard_key()))
    .bind(SHARDS)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Member {
                pid: r.try_get("pid")?,
                slot: r.try_get("slot")?,
                shards: r.try_get("shards")?,
                connected_at: r.try_get("backend_start")?,
                application_name: r.try_get("application_name")?,
                client_addr: r.try_get("client_addr")?,
            })
        })
        .collect()
}

/// Registers (or unregisters) this instance as waiting for work: while any instance waits,
/// emitters send NOTIFY.
pub(crate) async fn set_waiting(conn: &mut PgConnection, slot: i32, waiting: bool) -> Result<()> {
    let sql = if waiting {
        "INSERT INTO outbox_relay_waiting (slot) VALUES ($1) ON CONFLICT DO NOTHING"
    } else {
        "DELETE FROM outbox_relay_waiting WHERE slot = $1"
    };
    sqlx::query(sql).bind(slot).execute(&mut *conn).await?;
    Ok(())
}

/// Removes the waiting marks of instances that are gone (their member lock is free), and any
/// left under `slot` by its previous holder.
pub(crate) async fn clear_stale_waiting(conn: &mut PgConnection, slot: i32) -> Result<()> {
    sqlx::query(&format!(
        "DELETE FROM outbox_relay_waiting w WHERE w.slot = $3 OR NOT EXISTS ( \
             SELECT 1 FROM pg_locks l WHERE {} AND l.objid::int8 = $1 + w.slot)",
        shards::member_locks_sql(Kind::Relay)
    ))
    .bind(i64::from(Kind::Relay.member_key()))
    .bind(shards::MEMBER_SLOTS)
    .bind(slot)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Moves `owned` toward this instance's fair share of the shards: see [`shards::rebalance`].
/// Called only between batches, so a released shard has nothing in flight. Returns whether it
/// took shards (their rows below the instance's cursor are unknown to it).
pub(crate) async fn rebalance(
    conn: &mut PgConnection,
    table: Table,
    owned: &mut BTreeSet<i32>,
    slot: i32,
) -> Result<bool> {
    shards::rebalance(conn, table.space, owned, slot)
        .await
        .map(|(gained, _)| gained)
}

/// What the claim needs to know before it scans, read in the statement that begins the batch
/// (a simple query: `{mask}` and `{sequence}` are integers written in): the id sequence's value
/// and the oldest running transaction (for the horizon), the lowest failed row of the shards
/// that is due again, and whether any key of the shards is held back. An aggregate over
/// the failed rows with no order to exploit, so that the only sensible plan reads the small
/// index of failed rows, whatever the statistics say.
fn begin_sql(mask: i64, sequence: i64, floor: Option<DateTime<Utc>>) -> String {
    format!(
        "BEGIN; SELECT pg_sequence_last_value({sequence}::oid::regclass), \
           pg_snapshot_xmin(pg_current_snapshot())::text::int8, \
           min(r.id) FILTER (WHERE r.next_attempt_at <= now()), \
           coalesce(bool_or(r.next_attempt_at > now()), false) \
         FROM outbox_event r \
         WHERE r.published_at IS NULL AND r.next_attempt_at IS NOT NULL AND r.parked_at IS NULL \
           AND ({mask}::int8 >> (hashtext(r.partition_key) & 63)) & 1 = 1{}",
        floor_sql("r", floor)
    )
}

/// `AND <alias>.created_at >= '<floor>'` (nothing without a floor): a literal, so that the
/// planner leaves out the partitions below it (see `floor.rs`).
fn floor_sql(alias: &str, floor: Option<DateTime<Utc>>) -> String {
    floor.map_or_else(String::new, |f| {
        format!(
            " AND {alias}.created_at >= '{}'::timestamptz",
            f.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
        )
    })
}

/// The claim: the shards' rows after the cursor `$3`, in `id` order, skipping rows waiting for
/// a retry and, when `$4` says some key is held back, the later rows of such keys. With a
/// floor, [`claim_sql`] adds it.
const CLAIM_SQL: &str = concat!(
    "SELECT ",
    claimed_columns!(),
    " FROM outbox_event o \
     WHERE o.id > $3 AND o.published_at IS NULL AND o.parked_at IS NULL \
       AND ($1::int8 >> (hashtext(o.partition_key) & 63)) & 1 = 1 \
       AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now()) \
       AND (NOT $4 OR NOT EXISTS ( \
           SELECT 1 FROM outbox_event b \
           WHERE b.published_at IS NULL AND b.next_attempt_at IS NOT NULL \
             AND b.parked_at IS NULL AND b.next_attempt_at > now() \
             AND b.partition_key = o.partition_key AND b.id + 0 < o.id)) \
     ORDER BY o.id LIMIT $2 \
     FOR UPDATE OF o SKIP LOCKED"
);

/// [`CLAIM_SQL`] with the floor's condition on both of its scans.
fn claim_sql(floor: DateTime<Utc>) -> String {
    CLAIM_SQL
        .replacen(
            "WHERE o.id > $3",
            &format!("WHERE o.id > $3{}", floor_sql("o", Some(floor))),
            1,
        )
        .replacen(
            "AND b.partition_key = o.partition_key",
            &format!(
                "AND b.partition_key = o.partition_key{}",
                floor_sql("b", Some(floor))
            ),
            1,
        )
}

/// What [`claim`] found.
#[derive(Debug)]
pub(crate) struct Claim {
    pub rows: Vec<Claimed>,
    /// Where the scan started (exclusive): the cursor, or lower for a failed row due again.
    pub from: i64,
    /// `pg_sequence_last_value` of the id sequence, read before the claim locked anything.
    pub sequence: i64,
    /// The oldest transaction running when the batch began (its snapshot's `xmin`).
    pub snapshot_xmin: i64,
}

/// Begins the batch's transaction and claims up to `limit` rows of the shards after `cursor`
/// (or from a failed row due again, if lower), in `id` order.
pub(crate) async fn claim(
    conn: &mut PgConnection,
    table: Table,
    shards: &BTreeSet<i32>,
    cursor: i64,
    limit: i64,
    floor: Option<DateTime<Utc>>,
) -> Result<Claim> {
    let mask = shard_mask(shards);
    let begun = begin_claim(conn, table, mask, cursor, floor).await?;
    let with_floor = floor.map(claim_sql);
    // With a floor, its text changes with it: not prepared (and planned with the floor, so
    // that the partitions below it are left out).
    let query = match &with_floor {
        Some(sql) => sqlx::query(sql).persistent(false),
        None => sqlx::query(CLAIM_SQL),
    };
    let rows = query
        .bind(mask)
        .bind(limit)
        .bind(begun.from)
        .bind(begun.held)
        .fetch_all(&mut *conn)
        .await?;
    Ok(Claim {
        rows: rows
            .iter()
            .map(|r| Claimed::from_row(r, 0))
            .collect::<Result<_>>()?,
        from: begun.from,
        sequence: begun.sequence,
        snapshot_xmin: begun.snapshot_xmin,
    })
}

/// What [`begin_claim`] read.
struct Begun {
    sequence: i64,
    snapshot_xmin: i64,
    /// Where the scan starts (exclusive).
    from: i64,
    /// Whether a key of the shards is held back by a failed row.
    held: bool,
}

/// Begins the batch and reads what the claim needs.
async fn begin_claim(
    conn: &mut PgConnection,
    table: Table,
    mask: i64,
    cursor: i64,
    floor: Option<DateTime<Utc>>,
) -> Result<Begun> {
    let sql = begin_sql(mask, table.id_sequence, floor);
    let row = conn.fetch_one(sql.as_str()).await?;
    let sequence: Option<i64> = row.try_get(0)?;
    let due: Option<i64> = row.try_get(2)?;
    Ok(Begun {
        sequence: sequence.unwrap_or(0),
        snapshot_xmin: row.try_get(1)?,
        from: due.map_or(cursor, |due| cursor.min(due - 1)),
        held: row.try_get(3)?,
    })
}

/// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` of the claim, rolled back.
#[cfg(feature = "testing")]
pub(crate) async fn explain_claim(
    conn: &mut PgConnection,
    table: Table,
    shards: &BTreeSet<i32>,
    cursor: i64,
    limit: i64,
) -> Result<serde_json::Value> {
    let mask = shard_mask(shards);
    let begun = begin_claim(conn, table, mask, cursor, None).await?;
    let plan: serde_json::Value = sqlx::query_scalar(&format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {CLAIM_SQL}"
    ))
    .bind(mask)
    .bind(limit)
    .bind(begun.from)
    .bind(begun.held)
    .fetch_one(&mut *conn)
    .await?;
    abandon(conn).await?;
    Ok(plan)
}

/// A record the broker refused.
pub(crate) struct Refused {
    pub id: i64,
    pub error: String,
    /// Seconds until the next attempt.
    pub backoff_secs: f64,
    /// An operator's problem (unknown topic, not authorized): the key is held, not counted as
    /// an attempt, never parked.
    pub held: bool,
}

/// What [`finish`] reports.
pub(crate) struct Finished {
    /// Rows parked now.
    pub parked: u64,
    /// The batch's own transaction id (taken when the claim locked its first row, so after the
    /// claim read the id sequence).
    pub xid: Option<i64>,
}

/// Records the batch's outcome and commits: `published` rows get `published_at`, `failed`
/// rows an attempt (and are parked at `max_attempts`) or a hold. `since_ms` is the lowest
/// `created_at` of the batch's rows (ms since the epoch): the updates say it, so that on a
/// partitioned outbox they look only into the partitions that can hold the rows.
pub(crate) async fn finish(
    conn: &mut PgConnection,
    published: &[i64],
    failed: &[Refused],
    max_attempts: i32,
    since_ms: i64,
) -> Result<Finished> {
    // A second early: `created_at_ms` is rounded.
    let since = format!(
        "to_timestamp({}::float8 / 1000)",
        since_ms.saturating_sub(1000)
    );
    let mut parked = 0;
    if !failed.is_empty() {
        let ids: Vec<i64> = failed.iter().map(|f| f.id).collect();
        let errors: Vec<&str> = failed.iter().map(|f| f.error.as_str()).collect();
        let backoffs: Vec<f64> = failed.iter().map(|f| f.backoff_secs).collect();
        let held: Vec<bool> = failed.iter().map(|f| f.held).collect();
        let rows = sqlx::query(&format!(
            "UPDATE outbox_event o SET \
                 attempts = o.attempts + CASE WHEN f.held THEN 0 ELSE 1 END, \
                 last_error = f.error, \
                 next_attempt_at = CASE WHEN NOT f.held AND o.attempts + 1 >= $4 THEN NULL \
                                        ELSE now() + make_interval(secs => f.backoff) END, \
                 held_at = CASE WHEN f.held THEN coalesce(o.held_at, now()) END, \
                 parked_at = CASE WHEN NOT f.held AND o.attempts + 1 >= $4 THEN now() END \
             FROM unnest($1::int8[], $2::text[], $3::float8[], $5::bool[]) \
                 AS f(id, error, backoff, held) \
             WHERE o.id = f.id AND o.created_at >= {since} \
             RETURNING o.parked_at IS NOT NULL AS parked"
        ))
        // Its text changes with every batch: not worth a prepared statement.
        .persistent(false)
        .bind(&ids)
        .bind(&errors)
        .bind(&backoffs)
        .bind(max_attempts)
        .bind(&held)
        .fetch_all(&mut *conn)
        .await?;
        for row in rows {
            if row.try_get::<bool, _>("parked")? {
                parked += 1;
            }
        }
    }
    // The ids are integers: a literal array is exact, and lets the update and COMMIT share one
    // round trip.
    let mut sql = String::with_capacity(published.len() * 12 + 128);
    if !published.is_empty() {
        sql.push_str(
            "UPDATE outbox_event SET published_at = now(), next_attempt_at = NULL, held_at = NULL \
             WHERE id = ANY('{",
        );
        for (i, id) in published.iter().enumerate() {
            if i > 0 {
                sql.push(',');
            }
            sql.push_str(&id.to_string());
        }
        sql.push_str("}'::int8[]) AND created_at >= ");
        sql.push_str(&since);
        sql.push_str("; ");
    }
    sql.push_str("SELECT pg_current_xact_id_if_assigned()::text::int8; COMMIT");
    let row = conn.fetch_one(sql.as_str()).await?;
    Ok(Finished {
        parked,
        xid: row.try_get(0)?,
    })
}

/// Ends a batch without recording anything.
pub(crate) async fn abandon(conn: &mut PgConnection) -> Result<()> {
    conn.execute("ROLLBACK").await?;
    Ok(())
}

/// The backlog figures of `relay::status`: unpublished (not parked), retrying, held, parked,
/// and the age in seconds of the oldest unpublished row that is not parked.
pub(crate) async fn backlog(pool: &sqlx::PgPool) -> Result<(i64, i64, i64, i64, Option<f64>)> {
    Ok(sqlx::query_as(
        "SELECT count(*) FILTER (WHERE parked_at IS NULL), \
                count(*) FILTER (WHERE parked_at IS NULL AND next_attempt_at IS NOT NULL), \
                count(*) FILTER (WHERE parked_at IS NULL AND held_at IS NOT NULL), \
                count(*) FILTER (WHERE parked_at IS NOT NULL), \
                extract(epoch FROM now() - min(created_at) FILTER (WHERE parked_at IS NULL))::float8 \
         FROM outbox_event WHERE published_at IS NULL",
    )
    .fetch_one(pool)
    .await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_floor_bounds_both_scans_of_the_claim_and_the_due_rows() {
        let floor = DateTime::parse_from_rfc3339("2026-12-03T07:34:09.278039Z")
            .unwrap()
            .with_timezone(&Utc);
        let literal = "created_at >= '2026-12-03T07:34:09.278039Z'::timestamptz";
        let claim = claim_sql(floor);
        assert!(
            claim.contains(&format!("WHERE o.id > $3 AND o.{literal}")),
            "{claim}"
        );
        assert!(claim.contains(&format!("AND b.{literal}")), "{claim}");
        assert_eq!(
            claim
                .replace(&format!(" AND o.{literal}"), "")
                .replace(&format!(" AND b.{literal}"), ""),
            CLAIM_SQL
        );
        let begin = begin_sql(0, 1, Some(floor));
        assert!(
            begin.ends_with(&format!("& 1 = 1 AND r.{literal}")),
            "{begin}"
        );
        assert!(!begin_sql(0, 1, None).contains("created_at"));
    }
}
