//! `--console`: the outbox's operator console for each service's database, on one server:
//! `/orders` and `/payments`, each the runtime's console router mounted at its path.

use axum::response::Redirect;
use axum::routing::get;
use axum::Router;
use outbox_runtime::console::{self, ConsoleSettings};
use sqlx::PgPool;

use super::Result;

/// Read-only, unless `OUTBOX_CONSOLE_TOKEN` holds a token that allows the actions.
pub fn router(orders_db: &PgPool, payments_db: &PgPool) -> Result<Router> {
    let token = std::env::var("OUTBOX_CONSOLE_TOKEN")
        .ok()
        .filter(|t| !t.is_empty());
    let settings = |path: &str| {
        let settings = ConsoleSettings::default().mounted_at(path);
        match &token {
            Some(token) => settings.allow_actions(token.clone()),
            None => settings,
        }
    };
    Ok(Router::new()
        .nest(
            "/orders",
            console::router(orders_db.clone(), settings("/orders"))?,
        )
        .nest(
            "/payments",
            console::router(payments_db.clone(), settings("/payments"))?,
        )
        .route("/", get(|| async { Redirect::to("/orders") })))
}
