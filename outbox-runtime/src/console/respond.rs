//! What every route shares: a failure as a page of the console, a query that does not parse,
//! the health warnings at the top of a page.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::pages::{self, Page};
use super::Console;

pub(super) type Shared = State<Arc<Console>>;

/// An error page: bad input (400) or a failed query (500).
pub(super) struct ErrorPage(StatusCode, String);

impl From<crate::Error> for ErrorPage {
    fn from(e: crate::Error) -> Self {
        ErrorPage(
            StatusCode::INTERNAL_SERVER_ERROR,
            crate::error_chain(&e).to_string(),
        )
    }
}

pub(super) fn bad_input(message: impl Into<String>) -> ErrorPage {
    ErrorPage(StatusCode::BAD_REQUEST, message.into())
}

/// Renders a failure as a page of the console.
pub(super) async fn fail(
    console: Arc<Console>,
    headers: HeaderMap,
    failure: ErrorPage,
) -> Response {
    let ErrorPage(status, message) = failure;
    let page = Page::new(&console, &headers, None);
    (
        status,
        pages::message(
            &page,
            status.canonical_reason().unwrap_or("Error"),
            &message,
        ),
    )
        .into_response()
}

macro_rules! attempt {
    ($console:expr, $headers:expr, $body:expr) => {
        match $body {
            Ok(response) => response,
            Err(failure) => {
                return $crate::console::respond::fail($console, $headers, failure).await
            }
        }
    };
}
pub(super) use attempt;

/// The health warnings for the top of a page; a failed check is one line there, not a
/// failed page.
pub(super) async fn warnings(console: &Arc<Console>) -> pages::Warnings {
    console.start_sampler();
    match console.latest_health().await {
        Ok(health) => pages::Warnings::Checked(health),
        Err(e) => pages::Warnings::Failed(crate::error_chain(&e).to_string()),
    }
}

pub(super) fn with_query(path: String, query: &str) -> String {
    if query.is_empty() {
        path
    } else {
        format!("{path}?{query}")
    }
}

/// A query string that does not parse (a field given twice, say) as a page of the console.
pub(super) fn query_of<T>(query: Result<Query<T>, QueryRejection>) -> Result<T, ErrorPage> {
    query.map(|Query(q)| q).map_err(|e| {
        bad_input(format!(
            "The address's query does not parse: {}",
            e.body_text()
        ))
    })
}
