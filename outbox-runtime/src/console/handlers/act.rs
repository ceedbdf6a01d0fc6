//! The actions on parked and dead rows: retry, skip, discard, each behind a confirmation, on
//! exactly the rows the operator was shown.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Redirect, Response};
use uuid::Uuid;

use crate::admin::{self, PoisonFilter};
use crate::console::auth::{self, Refusal};
use crate::console::lists::{Action, List};
use crate::console::pages::{self, count, Page, Row};
use crate::console::respond::{attempt, bad_input, warnings, with_query, ErrorPage, Shared};
use crate::console::Console;

/// An action form's fields.
#[derive(Debug, Default)]
struct ActionForm {
    ids: Vec<String>,
    form_key: Option<String>,
    confirmed: bool,
    /// The list page's query to return to.
    back: String,
}

/// A list page's query from a form's `back` field: its filter's fields only, encoded again.
fn list_query(back: &str) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    for (name, value) in form_urlencoded::parse(back.as_bytes()) {
        if matches!(&*name, "topic" | "type" | "since" | "until") {
            query.append_pair(&name, &value);
        }
    }
    query.finish()
}

fn parse_form(body: &[u8]) -> ActionForm {
    let mut form = ActionForm::default();
    let mut only = None;
    for (name, value) in form_urlencoded::parse(body) {
        match &*name {
            "id" => form.ids.push(value.into_owned()),
            "only" => only = Some(value.into_owned()),
            "form_key" => form.form_key = Some(value.into_owned()),
            "confirmed" => form.confirmed = value == "1",
            "back" => form.back = list_query(&value),
            _ => {}
        }
    }
    // A row's own button acts on that row alone, whatever else is ticked.
    if let Some(only) = only {
        form.ids = vec![only];
    }
    form
}

pub(in crate::console) async fn parked_retry(
    s: Shared,
    h: HeaderMap,
    u: Uri,
    body: Bytes,
) -> Response {
    act(s, h, u, body, Action::RetryParked).await
}

pub(in crate::console) async fn parked_skip(
    s: Shared,
    h: HeaderMap,
    u: Uri,
    body: Bytes,
) -> Response {
    act(s, h, u, body, Action::SkipParked).await
}

pub(in crate::console) async fn dead_retry(
    s: Shared,
    h: HeaderMap,
    u: Uri,
    body: Bytes,
) -> Response {
    act(s, h, u, body, Action::RetryDead).await
}

pub(in crate::console) async fn dead_discard(
    s: Shared,
    h: HeaderMap,
    u: Uri,
    body: Bytes,
) -> Response {
    act(s, h, u, body, Action::DiscardDead).await
}

/// Checks who asks, lists the selected rows, and either asks to confirm or acts on exactly
/// those rows, logs it and returns to the list.
async fn act(
    State(console): Shared,
    headers: HeaderMap,
    uri: Uri,
    body: Bytes,
    action: Action,
) -> Response {
    let form = parse_form(&body);
    if let Err(refusal) = auth::may_act(&console, &headers, &uri, form.form_key.as_deref()) {
        tracing::warn!(
            target: "outbox_runtime::console",
            action = action.verb(),
            refusal = ?refusal,
            "console action refused"
        );
        let (status, text) = match refusal {
            Refusal::ReadOnly => (
                StatusCode::FORBIDDEN,
                "This console is read-only: it was started without actions allowed.",
            ),
            Refusal::NoToken => (
                StatusCode::UNAUTHORIZED,
                "Sign in with the console's token to act on rows.",
            ),
            Refusal::Forged => (
                StatusCode::FORBIDDEN,
                "Refused: the request did not come from this console's own page (another site, or a form without its anti-forgery field).",
            ),
        };
        let page = Page::new(&console, &headers, None);
        return (status, pages::message(&page, "Refused", text)).into_response();
    }
    let selected = attempt!(
        console.clone(),
        headers,
        select(&console, &form, action).await
    );
    let back = with_query(console.link(action.list().path()), &form.back);
    if selected.rows.is_empty() {
        let page = Page::new(&console, &headers, None);
        let text = "None of the selected rows is parked or dead any more: nothing to do.";
        return pages::message_back(&page, "Nothing to do", text, &back).into_response();
    }
    if !form.confirmed {
        let page = Page::new(&console, &headers, Some(warnings(&console).await));
        return pages::confirm(&page, action, &selected.rows, &form.back).into_response();
    }
    let changed = run(&console, action, &selected.filter).await;
    // Whatever it changed, the next page's warnings and figures are read again.
    console.acted();
    let changed = attempt!(console.clone(), headers, changed.map_err(ErrorPage::from));
    tracing::info!(
        target: "outbox_runtime::console",
        action = action.verb(),
        rows = changed,
        ids = %selected.rows.iter().map(|r| r.id.as_str()).collect::<Vec<_>>().join(","),
        "console action: {} {}",
        action.verb(),
        count(changed as i64, "row", "rows")
    );
    let sep = if back.contains('?') { '&' } else { '?' };
    Redirect::to(&format!("{back}{sep}done={}:{changed}", action.verb())).into_response()
}

/// The rows an action form selects that are still parked (or dead), and the filter of
/// exactly those.
struct Selected {
    rows: Vec<Row>,
    filter: PoisonFilter,
}

async fn select(
    console: &Console,
    form: &ActionForm,
    action: Action,
) -> std::result::Result<Selected, ErrorPage> {
    if form.ids.is_empty() {
        return Err(bad_input("Select at least one row."));
    }
    if form.ids.len() > 1000 {
        return Err(bad_input("At most 1,000 rows at a time."));
    }
    let mut filter = PoisonFilter::all();
    for id in &form.ids {
        filter = match action.list() {
            List::Parked => filter.id(id
                .parse()
                .map_err(|_| bad_input(format!("`{id}` is not an outbox row id")))?),
            List::Dead => filter.event_id(
                Uuid::parse_str(id).map_err(|_| bad_input(format!("`{id}` is not an event id")))?,
            ),
        };
    }
    // The rows as they are now; the action then takes exactly these.
    let rows: Vec<Row> = match action.list() {
        List::Parked => admin::list_parked_summaries(&console.pool, &filter)
            .await?
            .iter()
            .map(Row::parked)
            .collect(),
        List::Dead => admin::list_dead_summaries(&console.pool, &filter)
            .await?
            .iter()
            .map(Row::dead)
            .collect(),
    };
    let exact = rows
        .iter()
        .fold(PoisonFilter::all(), |f, r| match action.list() {
            List::Parked => f.id(r.id.parse().expect("an outbox id")),
            List::Dead => f.event_id(Uuid::parse_str(&r.id).expect("an event id")),
        });
    Ok(Selected {
        rows,
        filter: exact,
    })
}

/// What a row retried from the console records as what retried it.
const RETRIED_BY: &str = "Retry in the console";

async fn run(console: &Console, action: Action, filter: &PoisonFilter) -> crate::Result<u64> {
    match action {
        Action::RetryParked => admin::retry_parked_by(&console.pool, filter, RETRIED_BY).await,
        Action::SkipParked => admin::drop_parked(&console.pool, filter).await,
        Action::RetryDead => admin::retry_dead_by(&console.pool, filter, RETRIED_BY).await,
        Action::DiscardDead => admin::discard_dead(&console.pool, filter).await,
    }
}
