//! The relay's SQL on MariaDB and MySQL: its session, shard ownership through `GET_LOCK`, the
//! claim, the marks. The relay's loop (`relay/mysql.rs`) calls it.
//!
//! **No cursor.** `AUTO_INCREMENT` ids are taken at insert, not at commit, and nothing tells
//! which ids are still in flight (PostgreSQL's relay reads that from its snapshot). So every
//! claim reads the owned shards' unpublished rows from the first, through
//! `ix_outbox_event_claim` (`published_at, parked_at, id, key_bucket`: both NULL, then `id`
//! order, no sort): a lower id that commits after a higher one is claimed by the next batch.
//! The price: every claim walks the rows held back behind a key that waits for a retry
//! (BENCHMARKS.md, "The relay on MariaDB").
//!
//! **READ COMMITTED**, on the relay's session: each statement reads what has committed when it
//! runs, and a locking read takes no gap locks (under REPEATABLE READ a claim at the end of the
//! unpublished rows would make every emitter's insert wait for the batch). With statement-based
//! binary logging InnoDB refuses every write at READ COMMITTED: [`open`] says what to change.
//!
//! **Shards.** A key's shard is `key_bucket & 63` (the bucket its emitter locked, CRC32 of the
//! key); an instance owns shards through session-level named locks (`GET_LOCK`), released by
//! the server when the session ends (closed, killed, or idle past `wait_timeout`, which the
//! relay's session sets to the failover timeout).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use sqlx::{Connection, Executor, MySqlConnection, MySqlPool, Row};

use crate::error::{Error, Result};
use crate::store::record::{Claimed, MYSQL_CLAIMED_COLUMNS};
use crate::store::relay::Refused;
use crate::store::shards::{Plan, SHARDS};

// An instance past the 256th (`MEMBER_SLOTS`) waits for a slot; the 64 shards would leave it
// idle anyway.
use crate::admin::mysql::{LOCK_PREFIX_SQL, MEMBER_SLOTS};

/// One relay instance's session: its connection and the names of its locks.
pub(crate) struct Session {
    pub(crate) conn: MySqlConnection,
    /// `outbox:r:<MD5 of the database's name>`: the locks of this database's relays (a lock
    /// name is the server's, across databases; at most 64 characters on MySQL).
    prefix: String,
    pub(crate) slot: i32,
}

/// A relay session: out of the pool, set up, checked, with a member slot.
pub(crate) async fn open(pool: &MySqlPool, failover: Duration) -> Result<Session> {
    let mut conn = pool.acquire().await?.detach();
    // Whole seconds, rounded up: the session must outlive the relay's own waits.
    let secs = failover.as_secs_f64().ceil().max(1.0) as u64;
    let row = sqlx::query(&format!(
        "SELECT VERSION(), DATABASE(), CAST(@@log_bin AS SIGNED), CAST(@@binlog_format AS CHAR), \
                (SELECT COUNT(*) FROM information_schema.COLUMNS \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'outbox_event' \
                   AND COLUMN_NAME = 'waiting_bucket'), \
                {LOCK_PREFIX_SQL}, \
                CAST(@@read_only AS SIGNED) + CAST(@@innodb_read_only AS SIGNED)"
    ))
    .fetch_one(&mut conn)
    .await?;
    let version: String = row.try_get(0)?;
    super::migrate::check_version(&version)?;
    // A statement the relay gave up on (its failover timeout) is ended by the server too, not
    // left running with the session's locks: MariaDB bounds every statement, MySQL SELECTs.
    let statement_limit = if version.contains("MariaDB") {
        format!("SESSION max_statement_time = {secs}")
    } else {
        format!("SESSION max_execution_time = {}", secs * 1000)
    };
    // (`Executor`'s methods, not `RawSql`'s: those are generic over the executor, and trip
    // the compiler's `Send` analysis of the relay's future.)
    let settings = format!(
        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED; \
         SET SESSION autocommit = 1, SESSION wait_timeout = {secs}, \
             SESSION net_read_timeout = {secs}, SESSION net_write_timeout = {secs}, \
             SESSION innodb_lock_wait_timeout = {secs}, SESSION group_concat_max_len = 4194304, \
             {statement_limit}"
    );
    conn.execute(sqlx::raw_sql(&settings)).await?;
    let database: Option<String> = row.try_get(1)?;
    if database.is_none() {
        return Err(Error::Config(
            "the MySQL connection has no database: name one in the URL (mysql://host/database)"
                .into(),
        ));
    }
    let log_bin: i64 = row.try_get(2)?;
    let format: String = row.try_get(3)?;
    check_binlog(log_bin != 0, &format)?;
    let migrated: i64 = row.try_get(4)?;
    if migrated == 0 {
        return Err(Error::Config(
            "outbox_event is missing or not migrated for the relay: run the migrations \
             (`outbox migrate` with the mysql:// URL, or outbox_runtime::mysql::migrate)"
                .into(),
        ));
    }
    let prefix: String = row.try_get(5)?;
    let read_only: i64 = row.try_get(6)?;
    if read_only != 0 {
        return Err(Error::Config(
            "the MariaDB/MySQL server is read-only (read_only or innodb_read_only: a replica?): \
             point the relay at the primary, where the application writes its outbox"
                .into(),
        ));
    }
    let slot = join(&mut conn, &prefix).await?;
    Ok(Session { conn, prefix, slot })
}

/// Refuses statement-based binary logging: InnoDB refuses every write at READ COMMITTED
/// there (error 1665).
pub(crate) fn check_binlog(log_bin: bool, format: &str) -> Result<()> {
    if log_bin && format.eq_ignore_ascii_case("STATEMENT") {
        return Err(Error::Config(
            "the server logs statements (binlog_format=STATEMENT): the relay marks rows at READ \
             COMMITTED, where InnoDB writes only with row-based logging; set binlog_format=ROW \
             (or MIXED) on the server"
                .into(),
        ));
    }
    Ok(())
}

/// Takes the first free member slot (retrying when another instance takes it first).
async fn join(conn: &mut MySqlConnection, prefix: &str) -> Result<i32> {
    for _ in 0..MEMBER_SLOTS {
        let free: Option<i64> = sqlx::query_scalar(
            "SELECT CAST(MIN(bucket) AS SIGNED) FROM outbox_key_lock \
             WHERE bucket < ? AND IS_FREE_LOCK(CONCAT(?, ':m:', bucket)) = 1",
        )
        .bind(MEMBER_SLOTS)
        .bind(prefix)
        .fetch_one(&mut *conn)
        .await?;
        let Some(slot) = free else { break };
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(CONCAT(?, ':m:', ?), 0)")
            .bind(prefix)
            .bind(slot)
            .fetch_one(&mut *conn)
            .await?;
        if got == Some(1) {
            return Ok(slot as i32);
        }
    }
    Err(Error::Config(format!(
        "no free relay member slot (more than {MEMBER_SLOTS} relays of this database?)"
    )))
}

/// Moves `owned` toward this instance's fair share of the shards. Called between batches only.
/// Returns whether it took shards.
pub(crate) async fn rebalance(session: &mut Session, owned: &mut BTreeSet<i32>) -> Result<bool> {
    let members = crate::admin::mysql::members(&mut session.conn).await?;
    match Plan::new(owned, members, session.slot) {
        Plan::Keep => Ok(false),
        Plan::Release(extra) => {
            shard_locks(session, "RELEASE_LOCK", &extra).await?;
            for s in extra {
                owned.remove(&s);
            }
            Ok(false)
        }
        Plan::Take { candidates, need } => {
            let got = shard_locks(session, "GET_LOCK", &candidates).await?;
            let (keep, give_back) = got.split_at(got.len().min(need));
            owned.extend(keep);
            if !give_back.is_empty() {
                shard_locks(session, "RELEASE_LOCK", give_back).await?;
            }
            Ok(!keep.is_empty())
        }
    }
}

/// Calls `GET_LOCK(name, 0)` or `RELEASE_LOCK(name)` for each of `shards`; returns those
/// for which it answered 1, in `shards`' order.
async fn shard_locks(session: &mut Session, function: &str, shards: &[i32]) -> Result<Vec<i32>> {
    if shards.is_empty() {
        return Ok(Vec::new());
    }
    let wait = if function == "GET_LOCK" { ", 0" } else { "" };
    let list = shards
        .iter()
        .map(i32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let done: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT CAST(bucket AS SIGNED) FROM outbox_key_lock \
         WHERE bucket IN ({list}) AND {function}(CONCAT(?, ':s:', bucket){wait}) = 1"
    ))
    .bind(&session.prefix)
    .fetch_all(&mut session.conn)
    .await?;
    Ok(shards
        .iter()
        .copied()
        .filter(|s| done.contains(&i64::from(*s)))
        .collect())
}

/// Begins the batch's transaction and claims up to `limit` rows of the owned shards, in `id`
/// order from the first unpublished: not parked, not waiting for a retry, and not behind a row
/// of their key that waits for one (`ix_outbox_event_waiting`: the waiting rows alone). One
/// round trip.
///
/// **Found first, then locked by id.** A locking scan would lock each row it reads before the
/// server tests the rest of its `WHERE` (the shard, the held keys), and free it only then: a
/// relay scanning past another's rows would lock them for a moment, and the owner's `SKIP
/// LOCKED` claim would pass them and take a later row of their key first. So the rows are found
/// by a plain read (at READ COMMITTED, what has committed when it runs: a key's rows commit in
/// `id` order, so the ones it finds of a key are its first), and only those are locked, by
/// primary key, in a statement prepared from their ids. Only their owner locks them; it waits
/// (rather than skips) for whatever else holds one, at most `innodb_lock_wait_timeout`.
pub(crate) async fn claim(
    session: &mut Session,
    shards: &BTreeSet<i32>,
    limit: i64,
) -> Result<Vec<Claimed>> {
    let mask = crate::store::shards::shard_mask(shards) as u64;
    let of_shards = if shards.len() == SHARDS as usize {
        String::new()
    } else {
        format!(" AND ({mask} >> (f.key_bucket & 63)) & 1 = 1")
    };
    // The index hints keep the plain read on its indexes whatever the statistics say.
    let columns = MYSQL_CLAIMED_COLUMNS.replace('\'', "''");
    let sql = format!(
        "START TRANSACTION; \
         SELECT GROUP_CONCAT(c.id ORDER BY c.id) INTO @outbox_claim FROM ( \
             SELECT f.id FROM outbox_event f FORCE INDEX (ix_outbox_event_claim) \
             WHERE f.published_at IS NULL AND f.parked_at IS NULL{of_shards} \
               AND (f.next_attempt_at IS NULL OR f.next_attempt_at <= UTC_TIMESTAMP(6)) \
               AND NOT EXISTS (SELECT 1 FROM outbox_event b FORCE INDEX (ix_outbox_event_waiting) \
                   WHERE b.waiting_bucket = f.key_bucket AND b.id < f.id \
                     AND b.next_attempt_at > UTC_TIMESTAMP(6) \
                     AND b.partition_key = f.partition_key) \
             ORDER BY f.id LIMIT {limit}) c; \
         SET @outbox_claim_sql = CONCAT('SELECT {columns} FROM outbox_event o \
             WHERE o.id IN (', COALESCE(@outbox_claim, '0'), ') \
               AND o.published_at IS NULL AND o.parked_at IS NULL ORDER BY o.id FOR UPDATE'); \
         PREPARE outbox_claim FROM @outbox_claim_sql; \
         EXECUTE outbox_claim; \
         DEALLOCATE PREPARE outbox_claim"
    );
    let rows = session.conn.fetch_all(sqlx::raw_sql(&sql)).await?;
    rows.iter().map(Claimed::from_mysql_row).collect()
}

/// Records the batch's outcome and commits: `published` rows get `published_at`, `failed`
/// rows an attempt (parked at `max_attempts`) or a hold. Returns how many it parked;
/// `attempts` is each failed row's count as claimed (the row is locked). One round trip
/// (one statement per kind of outcome: the failures sharing an error, a backoff and a fate
/// are one update), more only past [`MAX_ROUND_TRIP`].
pub(crate) async fn finish(
    session: &mut Session,
    published: &[i64],
    failed: &[(Refused, i32)],
    max_attempts: i32,
) -> Result<u64> {
    let mut statements = Vec::new();
    for ids in published.chunks(IDS_PER_STATEMENT) {
        statements.push(format!(
            "UPDATE outbox_event SET published_at = UTC_TIMESTAMP(6), next_attempt_at = NULL, \
             held_at = NULL WHERE id IN ({})",
            id_list(ids)
        ));
    }
    let mut parked = 0;
    let mut alike: BTreeMap<(bool, bool, i64, &str), Vec<i64>> = BTreeMap::new();
    for (f, attempts) in failed {
        let parks = !f.held && attempts + 1 >= max_attempts;
        parked += u64::from(parks);
        let micros = (f.backoff_secs.min(MAX_BACKOFF_SECS) * 1e6) as i64;
        alike
            .entry((f.held, parks, micros, cut(&f.error, MAX_ERROR_BYTES)))
            .or_default()
            .push(f.id);
    }
    for ((held, parks, micros, error), ids) in alike {
        for ids in ids.chunks(IDS_PER_STATEMENT) {
            let mut sql = format!(
                "UPDATE outbox_event SET attempts = attempts + {}, last_error = ",
                u8::from(!held)
            );
            crate::store::literal_mysql::push_text(&mut sql, error);
            if parks {
                sql.push_str(", next_attempt_at = NULL, parked_at = UTC_TIMESTAMP(6)");
            } else {
                sql.push_str(&format!(
                    ", next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL {micros} MICROSECOND"
                ));
            }
            if held {
                sql.push_str(", held_at = COALESCE(held_at, UTC_TIMESTAMP(6))");
            } else {
                sql.push_str(", held_at = NULL");
            }
            sql.push_str(&format!(" WHERE id IN ({})", id_list(ids)));
            statements.push(sql);
        }
    }
    let mut script = String::new();
    for statement in statements {
        if !script.is_empty() && script.len() + statement.len() > MAX_ROUND_TRIP {
            session.conn.execute(sqlx::raw_sql(&script)).await?;
            script.clear();
        }
        script.push_str(&statement);
        script.push_str("; ");
    }
    script.push_str("COMMIT");
    session.conn.execute(sqlx::raw_sql(&script)).await?;
    Ok(parked)
}

/// Ids in one `IN (...)` list, at most.
const IDS_PER_STATEMENT: usize = 10_000;

/// A round trip of `finish` is at most this long (MariaDB's default `max_allowed_packet` is
/// 16 MiB, MySQL's 64 MiB; a larger one would end the connection).
const MAX_ROUND_TRIP: usize = 4 << 20;

/// A broker's error is kept to this many bytes in `last_error` (a `TEXT`: 65,535 at most).
const MAX_ERROR_BYTES: usize = 8 << 10;

/// A retry is never set further than this (30 days): beyond, a date could overflow.
const MAX_BACKOFF_SECS: f64 = 30.0 * 86_400.0;

/// `text` cut to at most `max` bytes, at a character's boundary.
fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

fn id_list(ids: &[i64]) -> String {
    let mut list = String::with_capacity(ids.len() * 12);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            list.push(',');
        }
        list.push_str(&id.to_string());
    }
    list
}

/// Ends a batch without recording anything.
pub(crate) async fn abandon(session: &mut Session) -> Result<()> {
    session.conn.execute(sqlx::raw_sql("ROLLBACK")).await?;
    Ok(())
}

/// Closes the session politely (its locks go with it).
pub(crate) async fn close(session: Session) {
    let _ = session.conn.close().await;
}

#[cfg(test)]
mod tests {
    use super::check_binlog;

    #[test]
    fn an_error_is_cut_at_a_character_boundary() {
        assert_eq!(super::cut("abc", 8), "abc");
        assert_eq!(super::cut("héllo", 2), "h");
        assert_eq!(super::cut("héllo", 3), "hé");
    }

    #[test]
    fn statement_based_logging_is_refused_with_what_to_change() {
        assert!(check_binlog(false, "STATEMENT").is_ok());
        assert!(check_binlog(true, "ROW").is_ok());
        assert!(check_binlog(true, "MIXED").is_ok());
        let e = check_binlog(true, "STATEMENT").unwrap_err().to_string();
        assert!(e.contains("binlog_format=ROW"), "{e}");
    }
}
