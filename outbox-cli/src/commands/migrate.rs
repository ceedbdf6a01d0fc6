//! `outbox migrate`: apply the migrations, PostgreSQL's or (a `mysql://` URL) MariaDB's and
//! MySQL's.

use std::time::Duration;

use outbox_runtime::migrate::Migration;
use sqlx::mysql::MySqlPoolOptions;

use super::{chain, connect, is_mysql, Result};
use crate::args::Db;

pub async fn run(db: &Db) -> Result {
    if is_mysql(&db.database_url) {
        return run_mysql(db).await;
    }
    let pool = connect(db, 2).await?;
    let pending = outbox_runtime::migrate::pending(&pool)
        .await
        .map_err(chain)?;
    outbox_runtime::migrate(&pool).await.map_err(chain)?;
    report(&pending, outbox_runtime::migrate::MIGRATIONS.len());
    Ok(())
}

async fn run_mysql(db: &Db) -> Result {
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&db.database_url)
        .await
        .map_err(|e| format!("cannot connect to MariaDB/MySQL: {e}"))?;
    let pending = outbox_runtime::mysql::pending(&pool).await.map_err(chain)?;
    outbox_runtime::mysql::migrate(&pool).await.map_err(chain)?;
    report(&pending, outbox_runtime::mysql::MIGRATIONS.len());
    Ok(())
}

fn report(pending: &[Migration], all: usize) {
    if pending.is_empty() {
        out!("schema up to date ({all} migrations applied)");
    } else {
        for m in pending {
            out!("applied {} {}", m.version, m.description);
        }
        out!("applied {} migrations", pending.len());
    }
}
