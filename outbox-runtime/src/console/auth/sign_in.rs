//! Signing in with the token (a cookie), and out.

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

use super::checks;
use crate::console::pages::{self, Page};
use crate::console::respond::{attempt, query_of, Shared};
use crate::console::Console;

#[derive(Debug, Deserialize)]
pub(in crate::console) struct LoginQuery {
    next: Option<String>,
}

pub(in crate::console) async fn login_page(
    State(console): Shared,
    headers: HeaderMap,
    query: Result<Query<LoginQuery>, QueryRejection>,
) -> Response {
    let query = attempt!(console.clone(), headers, query_of(query));
    let page = Page::new(&console, &headers, None);
    pages::login(&page, query.next.as_deref().unwrap_or(""), None).into_response()
}

pub(in crate::console) async fn login(
    State(console): Shared,
    headers: HeaderMap,
    uri: Uri,
    body: Bytes,
) -> Response {
    let mut token = String::new();
    let mut next = String::new();
    for (name, value) in form_urlencoded::parse(&body) {
        match &*name {
            "token" => token = value.into_owned(),
            "next" => next = value.into_owned(),
            _ => {}
        }
    }
    let page = Page::new(&console, &headers, None);
    let Some(expected) = console.settings.token.as_deref() else {
        let text = "This console is read-only: it was started without actions allowed.";
        return (
            StatusCode::FORBIDDEN,
            pages::message(&page, "Read-only", text),
        )
            .into_response();
    };
    if !checks::same_origin(&headers, &uri) {
        tracing::warn!(target: "outbox_runtime::console", "console sign-in from another site refused");
        let text = "Refused: the sign-in did not come from this console's own page (behind a proxy, pass the Host header on).";
        return (
            StatusCode::FORBIDDEN,
            pages::login(&page, &next, Some(text)),
        )
            .into_response();
    }
    if !checks::same(token.trim(), expected) {
        tracing::warn!(target: "outbox_runtime::console", "console sign-in with a wrong token refused");
        return (
            StatusCode::UNAUTHORIZED,
            pages::login(&page, &next, Some("Wrong token.")),
        )
            .into_response();
    }
    let target = if within(&console, &next) {
        next
    } else {
        console.link("/")
    };
    let mut response = Redirect::to(&target).into_response();
    if let Ok(cookie) = HeaderValue::from_str(&checks::set_cookie(&console, Some(expected))) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}

/// Whether `next` is a page of this console, and only that however a browser reads it: the
/// console's path, then a path of plain characters (no `//`, `\`, tab or line break that a
/// browser would make another host of).
fn within(console: &Console, next: &str) -> bool {
    let base = console.settings.mounted_at.as_str();
    let Some(rest) = next.strip_prefix(base).and_then(|r| r.strip_prefix('/')) else {
        return false;
    };
    let plain = |c: char| c.is_ascii_alphanumeric() || "/-_.~?=&%+,;:".contains(c);
    !rest.starts_with('/') && rest.chars().all(plain)
}

pub(in crate::console) async fn logout(
    State(console): Shared,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    if !checks::same_origin(&headers, &uri) {
        let page = Page::new(&console, &headers, None);
        let text = "Refused: the sign-out did not come from this console's own page.";
        return (
            StatusCode::FORBIDDEN,
            pages::message(&page, "Refused", text),
        )
            .into_response();
    }
    let mut response = Redirect::to(&console.link("/")).into_response();
    if let Ok(cookie) = HeaderValue::from_str(&checks::set_cookie(&console, None)) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}
