//! What a consumer's loops share: its database, settings, handlers and broker; waiting out a
//! failed write; the advisory locks that serialize two consumers' work on one source.

use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use super::route::Routes;
use super::settings::Settings;

/// A consumer's parts, each of its own kind: the loops read them, nothing changes them.
pub(crate) struct Shared {
    pub(crate) pool: PgPool,
    pub(crate) settings: Settings,
    pub(crate) routes: Routes,
}

impl Shared {
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
        if crate::admin::partitions::is_missing_partition(error) {
            tracing::warn!(error = %crate::error_chain(error), "no {name} partition for now; creating partitions");
            if let Err(e) = crate::admin::create_partitions(&self.pool, table).await {
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

/// Takes a transaction-scoped advisory lock per source (`key`, then a hash of the schema and
/// the source), in hash order so that two transactions never deadlock.
pub(crate) async fn lock_sources(
    conn: &mut PgConnection,
    key: i32,
    sources: &[String],
) -> sqlx::Result<()> {
    sqlx::query(
        "SELECT count(pg_advisory_xact_lock($1, h)) \
         FROM (SELECT DISTINCT hashtext(current_schema() || k) AS h \
               FROM unnest($2::text[]) AS k ORDER BY 1) AS s",
    )
    .bind(key)
    .bind(sources)
    .execute(conn)
    .await?;
    Ok(())
}
