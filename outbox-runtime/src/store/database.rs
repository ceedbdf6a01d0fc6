//! [`Database`]: the database whose outbox a relay or a replay publishes (`relay::Database`).

use sqlx::PgPool;

/// The database whose outbox a relay or a replay publishes: a `sqlx::PgPool`, or with the
/// feature `mysql` a `sqlx::MySqlPool` (MariaDB 10.6+, MySQL 8.0.1+). [`Relay::builder`] and
/// the [`Replay`](crate::admin::Replay) constructors take either.
///
/// [`Relay::builder`]: crate::relay::Relay::builder
#[derive(Debug, Clone)]
pub struct Database(pub(crate) Pool);

#[derive(Debug, Clone)]
pub(crate) enum Pool {
    Postgres(PgPool),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

impl From<PgPool> for Database {
    fn from(pool: PgPool) -> Self {
        Database(Pool::Postgres(pool))
    }
}

impl From<&PgPool> for Database {
    fn from(pool: &PgPool) -> Self {
        Database(Pool::Postgres(pool.clone()))
    }
}

#[cfg(feature = "mysql")]
impl From<sqlx::MySqlPool> for Database {
    fn from(pool: sqlx::MySqlPool) -> Self {
        Database(Pool::MySql(pool))
    }
}

#[cfg(feature = "mysql")]
impl From<&sqlx::MySqlPool> for Database {
    fn from(pool: &sqlx::MySqlPool) -> Self {
        Database(Pool::MySql(pool.clone()))
    }
}
