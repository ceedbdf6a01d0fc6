//! What a consumer's loops share: its database, settings, handlers and forwarder.

use sqlx::PgPool;

use super::forward::Forwarder;
use super::route::Routes;
use super::settings::Settings;

/// A consumer's parts, each of its own kind: the loops read them, nothing changes them.
pub(crate) struct Shared {
    pub(crate) pool: PgPool,
    pub(crate) settings: Settings,
    pub(crate) routes: Routes,
    pub(crate) forwarder: Forwarder,
}
