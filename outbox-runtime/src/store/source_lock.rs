//! The transaction-scoped advisory locks that serialize two consumers' work on one source (a
//! topic's partition, in dedup mode per handler too), and the transaction they are taken in.
//! What makes an event handled or stored once when its table is partitioned (its unique key
//! then holds the partitioning column): see [`dedup`](super::dedup) and
//! [`inbox`](super::inbox), whose keys these locks are taken under.

use sqlx::{PgConnection, PgPool, Postgres, Transaction};

/// Begins a transaction at READ COMMITTED, whatever the role's default: each statement after
/// the locks then sees what a transaction that held them before committed.
pub(crate) async fn begin(pool: &PgPool) -> sqlx::Result<Transaction<'static, Postgres>> {
    pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await
}

/// Takes a transaction-scoped advisory lock per source (`key`, then a hash of the schema and
/// the source), in hash order so that two transactions never deadlock.
pub(crate) async fn lock(
    conn: &mut PgConnection,
    key: i32,
    sources: &[String],
) -> sqlx::Result<()> {
    sqlx::query(locks_sql!("$1", "$2"))
        .bind(key)
        .bind(sources)
        .execute(conn)
        .await?;
    Ok(())
}

/// [`lock`]'s statement, its key and sources the parameters named: how many locks it took. A
/// macro, so that another statement can hold it.
macro_rules! locks_sql {
    ($key:literal, $sources:literal) => {
        concat!(
            "SELECT count(pg_advisory_xact_lock(",
            $key,
            ", h)) \
             FROM (SELECT DISTINCT hashtext(current_schema() || k) AS h \
                   FROM unnest(",
            $sources,
            "::text[]) AS k ORDER BY 1) AS s"
        )
    };
}
pub(crate) use locks_sql;
