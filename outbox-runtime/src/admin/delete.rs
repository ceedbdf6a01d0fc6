//! Deleting rows past a cut-off in short batches: what retention does to a plain table, and to
//! a partition it keeps.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::error::Result;

/// Deletes the rows of `table` (a quoted name) that `condition` (with the cut-off as `$1`)
/// picks, oldest by `age` first, `batch_size` per transaction, skipping rows another
/// transaction holds; calls `progress` with the total so far after each batch. Returns how
/// many it deleted.
pub(crate) async fn delete_in_batches(
    pool: &PgPool,
    table: &str,
    condition: &str,
    age: &str,
    cutoff: DateTime<Utc>,
    batch_size: i64,
    mut progress: impl FnMut(u64),
) -> Result<u64> {
    // By ctid: a tid scan, whatever the table's key.
    let sql = format!(
        "DELETE FROM {table} WHERE ctid = ANY(ARRAY( \
             SELECT ctid FROM {table} WHERE {condition} ORDER BY {age} \
             LIMIT $2 FOR UPDATE SKIP LOCKED))"
    );
    let mut total = 0u64;
    loop {
        let deleted = sqlx::query(&sql)
            .bind(cutoff)
            .bind(batch_size)
            .execute(pool)
            .await?
            .rows_affected();
        if deleted == 0 {
            return Ok(total);
        }
        total += deleted;
        progress(total);
    }
}
