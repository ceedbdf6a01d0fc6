//! What a consumer's loops share: its database, settings, handlers and broker; waiting out a
//! failed write.

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::database::Db;
use super::route::Routes;
use super::settings::Settings;
use crate::sqlstate::{database_error, DbError};

/// A consumer's parts, each of its own kind: the loops read them, nothing changes them (but
/// `rows_waiting`, a signal, and `floor`, a computed bound).
pub(crate) struct Shared {
    pub(crate) db: Db,
    pub(crate) settings: Settings,
    pub(crate) routes: Routes,
    /// Bumped when inbox rows may have become due: a receipt stored new rows. This process's
    /// processors wait on it, and on their poll interval for what other processes receive,
    /// for retries coming due and for shards another processor gave up.
    pub(crate) rows_waiting: tokio::sync::watch::Sender<u64>,
    /// Where the processors' claims start (inbox mode).
    pub(crate) floor: super::floor::Floor,
}

impl Shared {
    pub(crate) fn new(db: Db, settings: Settings, routes: Routes) -> Shared {
        Shared {
            db,
            settings,
            routes,
            rows_waiting: tokio::sync::watch::Sender::new(0),
            floor: super::floor::Floor::default(),
        }
    }

    /// The PostgreSQL pool of what is built on PostgreSQL only so far: inbox mode, which
    /// `build` refuses on MariaDB/MySQL.
    pub(crate) fn pg(&self) -> &PgPool {
        self.db
            .pg("this")
            .expect("`build` refuses on MariaDB/MySQL what is built on PostgreSQL only")
    }

    /// Whether this consumer's database holds event `event_id` already: its effect (dedup
    /// mode: a `processed_event` row, for any handler) or its receipt (inbox mode).
    #[cfg(feature = "rabbitmq")]
    pub(crate) async fn holds(&self, event_id: uuid::Uuid) -> crate::error::Result<bool> {
        use super::settings::Mode;
        match (&self.db, self.settings.mode) {
            (Db::Postgres(pool), Mode::Dedup) => crate::store::dedup::holds(pool, event_id).await,
            (Db::Postgres(pool), Mode::Inbox) => crate::store::inbox::holds(pool, event_id).await,
            #[cfg(feature = "mysql")]
            (Db::MySql(pool), _) => crate::store::consumer_mysql::holds(pool, event_id).await,
        }
    }

    /// Wakes this process's processors.
    pub(crate) fn wake_processors(&self) {
        self.rows_waiting.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// After the `failures`-th failed write to `table` in a row: creates its partitions when
    /// the write found none for its rows (nothing created them ahead: no relay with retention,
    /// a consumer stopped for days), else logs the error; then waits the outage backoff.
    /// `false` once `cancel` fires.
    pub(crate) async fn wait_out(
        &self,
        error: &crate::Error,
        table: crate::admin::CleanupTable,
        failures: u32,
        cancel: &CancellationToken,
    ) -> bool {
        let name = table.table_name();
        let missing_partition = database_error(error).is_some_and(DbError::is_missing_partition);
        if let (true, Db::Postgres(pool)) = (missing_partition, &self.db) {
            tracing::warn!(error = %crate::error_chain(error), "no {name} partition for now; creating partitions");
            if let Err(e) = crate::admin::create_partitions(pool, table).await {
                tracing::warn!(error = %crate::error_chain(&e), "cannot create partitions");
            }
        } else {
            tracing::warn!(error = %crate::error_chain(error), "consumer cannot write {name}; retrying");
        }
        tokio::select! {
            () = cancel.cancelled() => false,
            () = tokio::time::sleep(self.settings.outage_backoff(failures)) => true,
        }
    }
}
