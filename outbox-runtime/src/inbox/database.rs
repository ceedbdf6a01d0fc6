//! The seam between a consumer and its database: which databases a consumer runs on
//! ([`ConsumerDatabase`]), the pool it holds ([`Db`]), and the connection a handler is given
//! ([`Conn`]) once its type is erased.
//!
//! The broker side and the core's loop (batches, verdicts, retries, what is settled when) are
//! written once; the transactions of a batch are each database's: `inbox/batch.rs` on
//! PostgreSQL, `inbox/batch_mysql.rs` on MariaDB and MySQL.

use sqlx::{PgConnection, PgPool};

#[cfg(feature = "mysql")]
use crate::error::Error;
use crate::error::Result;

/// A database a consumer runs on: `sqlx::Postgres`, or with the feature `mysql`, `sqlx::MySql`
/// (MariaDB 10.6+, MySQL 8.0.1+). [`Consumer::builder`](super::Consumer::builder) takes a pool
/// of either, and its handlers then join that database's transactions
/// ([`Handler<S, D>`](super::Handler)). Sealed: implemented for those two only.
pub trait ConsumerDatabase: sqlx::Database + sealed::Sealed {
    #[doc(hidden)]
    fn db(pool: sqlx::Pool<Self>) -> Db;
    #[doc(hidden)]
    fn conn(conn: Conn<'_>) -> Option<&mut Self::Connection>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for sqlx::Postgres {}
    #[cfg(feature = "mysql")]
    impl Sealed for sqlx::MySql {}
}

impl ConsumerDatabase for sqlx::Postgres {
    fn db(pool: PgPool) -> Db {
        Db::Postgres(pool)
    }

    fn conn(conn: Conn<'_>) -> Option<&mut PgConnection> {
        match conn {
            Conn::Postgres(c) => Some(c),
            #[cfg(feature = "mysql")]
            Conn::MySql(_) => None,
        }
    }
}

#[cfg(feature = "mysql")]
impl ConsumerDatabase for sqlx::MySql {
    fn db(pool: sqlx::MySqlPool) -> Db {
        Db::MySql(pool)
    }

    fn conn(conn: Conn<'_>) -> Option<&mut sqlx::MySqlConnection> {
        match conn {
            Conn::MySql(c) => Some(c),
            Conn::Postgres(_) => None,
        }
    }
}

/// A consumer's database.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub enum Db {
    Postgres(PgPool),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

impl Db {
    /// The PostgreSQL pool, for what is built on PostgreSQL only so far (inbox mode, leases,
    /// partitions); a clear error on MariaDB/MySQL, where `build` refuses those already.
    #[cfg_attr(not(feature = "mysql"), allow(unused_variables))]
    pub(crate) fn pg(&self, what: &str) -> Result<&PgPool> {
        match self {
            Db::Postgres(pool) => Ok(pool),
            #[cfg(feature = "mysql")]
            Db::MySql(_) => Err(Error::Config(format!(
                "{what} is not built on MariaDB/MySQL yet: a consumer on a `MySqlPool` runs in \
                 dedup mode (issue 38)"
            ))),
        }
    }
}

/// The connection a handler is called with, its database not erased.
#[doc(hidden)]
#[derive(Debug)]
pub enum Conn<'a> {
    Postgres(&'a mut PgConnection),
    #[cfg(feature = "mysql")]
    MySql(&'a mut sqlx::MySqlConnection),
}
