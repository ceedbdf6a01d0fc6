//! The pages, as HTML (maud). Each reads without JavaScript; `console.js` adds the refresh of
//! live figures, the confirmation dialogs and "select all".
//!
//! `frame.rs` is what every page shares (the request's [`Page`], the navigation, the
//! warnings), `format.rs` how figures, times and payloads are written; then a file per page or
//! family of pages.

mod event;
mod format;
mod frame;
mod login;
mod message;
mod overview;
mod poison;
mod relays;

pub(super) use event::event;
pub(super) use format::count;
pub(super) use frame::{Page, Warnings};
pub(super) use login::login;
pub(super) use message::{message, message_back};
pub(super) use overview::overview;
pub(super) use poison::{confirm, poison_list, Row};
pub(super) use relays::relays;
