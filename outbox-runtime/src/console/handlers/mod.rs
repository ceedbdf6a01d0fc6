//! The routes: read what a page shows (`read.rs`), or run an action (`act.rs`), then render;
//! the stylesheet and script (`assets.rs`). Signing in and the guard around every route are
//! `auth`'s; what every route shares is `respond.rs`.

mod act;
mod assets;
mod read;

pub(super) use act::{dead_discard, dead_retry, parked_retry, parked_skip};
pub(super) use assets::{css, js};
pub(super) use read::{dead, event, event_payload, not_found, overview, parked, relays};
