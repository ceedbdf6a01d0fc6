//! `outbox migrate`: apply the migrations.

use super::{chain, connect, Result};
use crate::args::Db;

pub async fn run(db: &Db) -> Result {
    let pool = connect(db, 2).await?;
    let pending = outbox_runtime::migrate::pending(&pool)
        .await
        .map_err(chain)?;
    outbox_runtime::migrate(&pool).await.map_err(chain)?;
    if pending.is_empty() {
        out!(
            "schema up to date ({} migrations applied)",
            outbox_runtime::migrate::MIGRATIONS.len()
        );
    } else {
        for m in &pending {
            out!("applied {} {}", m.version, m.description);
        }
        out!("applied {} migrations", pending.len());
    }
    Ok(())
}
