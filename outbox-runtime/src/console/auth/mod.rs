//! Who may act, and signing in: the token (cookie or `Authorization: Bearer`) and the checks
//! against requests forged by another site (`checks.rs`), the sign-in and sign-out routes
//! (`sign_in.rs`), and the guard around every route (`guard.rs`).

mod checks;
mod guard;
mod sign_in;

pub(super) use checks::{may_act, signed_in, Refusal};
pub(super) use guard::guard;
pub(super) use sign_in::{login, login_page, logout};
