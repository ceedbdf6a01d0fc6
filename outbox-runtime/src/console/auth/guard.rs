//! Around every route: where the console is nested, and the headers that keep its pages from
//! being framed by another site, sniffed or cached.

use axum::extract::{NestedPath, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::console::pages::{self, Page};
use crate::console::respond::Shared;

/// Around every route: the console must be nested where its links say (its settings'
/// `mounted_at`), and no page may be framed by another site, sniffed or cached.
pub(in crate::console) async fn guard(
    State(console): Shared,
    request: Request,
    next: Next,
) -> Response {
    let nested = request
        .extensions()
        .get::<NestedPath>()
        .map(|p| p.as_str().trim_end_matches('/').to_owned())
        .unwrap_or_default();
    let mut response = if nested != console.settings.mounted_at {
        let text = format!(
            "This console is nested at `{}`, but its settings say `{}`: its links and its \
             sign-in cookie would point elsewhere. Set ConsoleSettings::mounted_at(\"{}\").",
            if nested.is_empty() { "/" } else { &nested },
            if console.settings.mounted_at.is_empty() {
                "/"
            } else {
                &console.settings.mounted_at
            },
            nested
        );
        tracing::error!(target: "outbox_runtime::console", "{text}");
        let page = Page::new(&console, request.headers(), None);
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            pages::message(&page, "Misconfigured", &text),
        )
            .into_response()
    } else {
        next.run(request).await
    };
    let headers = response.headers_mut();
    for (name, value) in [
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::CONTENT_SECURITY_POLICY, "frame-ancestors 'none'"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "same-origin"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}
