//! What a unit of work needs of its database: writing rows, and the checked commit. PostgreSQL's
//! here; MySQL's in `mysql/emit.rs`.

use sqlx::{Database, Postgres, Transaction, TransactionManager};
use uuid::Uuid;

use super::commit::{commit_after, commit_error};
use super::insert::{event_types, insert, literal_emit};
use super::EmitFuture;
use crate::event::OutboxRecord;

/// A database a [`Uow`](crate::Uow) can write outbox rows in: PostgreSQL, and with the `mysql`
/// feature MariaDB and MySQL (`sqlx::MySql`). Sealed: this crate implements it.
pub trait EmitDatabase: Database + sealed::Sealed {
    /// Refuses a row this database's outbox cannot hold, when it is emitted.
    #[doc(hidden)]
    fn check(record: &OutboxRecord) -> crate::Result<()> {
        let _ = record;
        Ok(())
    }

    /// Writes `records` in order, with the key locks that keep each key's commit order.
    #[doc(hidden)]
    fn write<'a>(
        conn: &'a mut Self::Connection,
        records: &'a [OutboxRecord],
    ) -> EmitFuture<'a, Vec<Uuid>>;

    /// Writes `pending` and commits, checked: a transaction the server rolled back is never
    /// reported committed. A savepoint is released into its transaction instead.
    #[doc(hidden)]
    fn commit(tx: Transaction<'_, Self>, pending: Vec<OutboxRecord>) -> EmitFuture<'_, ()>;
}

pub(crate) mod sealed {
    pub trait Sealed {}
    impl Sealed for sqlx::Postgres {}
    #[cfg(feature = "mysql")]
    impl Sealed for sqlx::MySql {}
}

/// Whether `tx` is the outermost transaction (not a savepoint).
pub(crate) fn is_outermost<DB: Database>(tx: &mut Transaction<'_, DB>) -> bool {
    <DB as Database>::TransactionManager::get_transaction_depth(tx) == 1
}

impl EmitDatabase for Postgres {
    fn write<'a>(
        conn: &'a mut Self::Connection,
        records: &'a [OutboxRecord],
    ) -> EmitFuture<'a, Vec<Uuid>> {
        Box::pin(insert(conn, records))
    }

    fn commit(mut tx: Transaction<'_, Self>, pending: Vec<OutboxRecord>) -> EmitFuture<'_, ()> {
        Box::pin(async move {
            let event_types = event_types(&pending);
            if !is_outermost(&mut tx) {
                // A savepoint: release it into the transaction that holds it.
                insert(&mut tx, &pending).await?;
                return tx.commit().await.map_err(|e| commit_error(e, event_types));
            }
            // One simple query: the rows, COMMIT, and BEGIN of an empty transaction that the
            // dropped `Transaction` then rolls back (pipelined with the connection's next use),
            // so that sqlx's transaction depth and the server agree again without a round trip.
            // Without rows, `SELECT` stands in for them: in an aborted transaction it fails,
            // where a bare COMMIT would "succeed" with a rollback. On an error the server skips
            // the rest of the query, and the dropped transaction rolls back.
            let sql = if pending.is_empty() {
                String::from("SELECT")
            } else {
                literal_emit(&pending)?
            };
            commit_after(tx, sql, event_types).await
        })
    }
}
