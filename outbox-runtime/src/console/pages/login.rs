//! The sign-in page.

use maud::{html, Markup};

use super::frame::{layout, Nav, Page};

pub(in crate::console) fn login(page: &Page<'_>, next: &str, failure: Option<&str>) -> Markup {
    let content = html! {
        h1 { "Sign in" }
        @if let Some(failure) = failure { p.error #login-failed { (failure) } }
        p.note { "Actions (retry, skip, discard) need the token the console was started with." }
        form method="post" action=(page.link("/login")) {
            input type="hidden" name="next" value=(next);
            label { "Token " input #token type="password" name="token" autocomplete="current-password"; }
            " "
            button type="submit" { "Sign in" }
        }
    };
    layout(page, "Sign in", Nav::None, false, content)
}
