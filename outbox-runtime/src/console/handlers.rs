//! The routes: read what a page shows, or run an action, then render.

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Redirect, Response};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use uuid::Uuid;

use super::auth::{self, Refusal};
use super::lists::{given, parse_time, Action, List, ListQuery};
use super::pages::{self, Page, Row};
use super::respond::{attempt, bad_input, query_of, warnings, with_query, Failure, Shared};
use super::Console;
use crate::admin::{self, EventRef, PoisonFilter};

/// Counts of matching rows stop here: "10,000+" needs no scan of a million rows.
const COUNT_CAP: u32 = 10_000;

pub(super) async fn overview(State(console): Shared, headers: HeaderMap) -> Response {
    console.start_sampler();
    let health = attempt!(
        console.clone(),
        headers,
        console.latest_health().await.map_err(Failure::from)
    );
    let page = Page::new(
        &console,
        &headers,
        Some(pages::Warnings::Checked(health.clone())),
    );
    let samples = console.samples.lock().expect("samples");
    pages::overview(&page, &health, &samples).into_response()
}

pub(super) async fn relays(State(console): Shared, headers: HeaderMap) -> Response {
    console.start_sampler();
    let read = async {
        let instances = admin::relay_instances(&console.pool).await?;
        let held = admin::held_keys(&console.pool, 200).await?;
        Ok::<_, crate::Error>((instances, held))
    };
    let (instances, held) = attempt!(console.clone(), headers, read.await.map_err(Failure::from));
    // Since when each instance has held its shards, as far as this console has seen.
    let now = Utc::now();
    let since: Vec<DateTime<Utc>> = {
        let mut seen = console.shard_sets.lock().expect("shard sets");
        seen.retain(|pid, _| instances.iter().any(|i| i.pid == *pid));
        instances
            .iter()
            .map(|i| {
                let entry = seen.entry(i.pid).or_insert_with(|| {
                    (
                        i.shards.clone(),
                        console.started_at.max(i.connected_at.unwrap_or(now)),
                    )
                });
                if entry.0 != i.shards {
                    *entry = (i.shards.clone(), now);
                }
                entry.1
            })
            .collect()
    };
    let page = Page::new(&console, &headers, Some(warnings(&console).await));
    pages::relays(&page, &instances, &since, &held).into_response()
}

pub(super) async fn parked(
    State(console): Shared,
    headers: HeaderMap,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Response {
    let query = attempt!(console.clone(), headers, query_of(query));
    let read = async {
        let filter = query.filter().map_err(bad_input)?;
        let mut page_filter = filter.clone().limit(console.settings.page_size + 1);
        if let Some(after) = given(&query.after) {
            let id = after
                .parse()
                .map_err(|_| bad_input(format!("`after`: `{after}` is not a row id")))?;
            page_filter = page_filter.after_id(id);
        }
        let mut rows = admin::list_parked(&console.pool, &page_filter).await?;
        let total = admin::count_parked(&console.pool, &filter.limit(COUNT_CAP + 1)).await?;
        let next = (rows.len() > console.settings.page_size as usize).then(|| {
            rows.truncate(console.settings.page_size as usize);
            let last = rows.last().expect("a full page").id;
            let mut q = query.filter_query();
            q.push_str(if q.is_empty() { "" } else { "&" });
            q.push_str(&format!("after={last}"));
            with_query(console.link("/parked"), &q)
        });
        Ok::<_, Failure>((rows, total, next))
    };
    let (rows, total, next) = attempt!(console.clone(), headers, read.await);
    let rows: Vec<Row> = rows.iter().map(Row::parked).collect();
    let page = Page::new(&console, &headers, Some(warnings(&console).await));
    pages::poison_list(&page, List::Parked, &query, &rows, total, COUNT_CAP, next).into_response()
}

pub(super) async fn dead(
    State(console): Shared,
    headers: HeaderMap,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Response {
    let query = attempt!(console.clone(), headers, query_of(query));
    let read = async {
        let filter = query.filter().map_err(bad_input)?;
        let mut page_filter = filter.clone().limit(console.settings.page_size + 1);
        match (given(&query.after), given(&query.after_id)) {
            (Some(at), Some(id)) => {
                let at = parse_time("after", at).map_err(bad_input)?;
                let id = Uuid::parse_str(id)
                    .map_err(|_| bad_input(format!("`after_id`: `{id}` is not an event id")))?;
                page_filter = page_filter.after_received(at, id);
            }
            (None, None) => {}
            _ => return Err(bad_input("`after` and `after_id` go together")),
        }
        let mut rows = admin::list_dead(&console.pool, &page_filter).await?;
        let total = admin::count_dead(&console.pool, &filter.limit(COUNT_CAP + 1)).await?;
        let next = (rows.len() > console.settings.page_size as usize).then(|| {
            rows.truncate(console.settings.page_size as usize);
            let last = rows.last().expect("a full page");
            let mut q = form_urlencoded::Serializer::new(query.filter_query());
            q.append_pair("after", &last.received_at.to_rfc3339());
            q.append_pair("after_id", &last.event_id.to_string());
            with_query(console.link("/dead"), &q.finish())
        });
        Ok::<_, Failure>((rows, total, next))
    };
    let (rows, total, next) = attempt!(console.clone(), headers, read.await);
    let rows: Vec<Row> = rows.iter().map(Row::dead).collect();
    let page = Page::new(&console, &headers, Some(warnings(&console).await));
    pages::poison_list(&page, List::Dead, &query, &rows, total, COUNT_CAP, next).into_response()
}

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

pub(super) async fn parked_retry(s: Shared, h: HeaderMap, u: Uri, body: Bytes) -> Response {
    act(s, h, u, body, Action::RetryParked).await
}

pub(super) async fn parked_skip(s: Shared, h: HeaderMap, u: Uri, body: Bytes) -> Response {
    act(s, h, u, body, Action::SkipParked).await
}

pub(super) async fn dead_retry(s: Shared, h: HeaderMap, u: Uri, body: Bytes) -> Response {
    act(s, h, u, body, Action::RetryDead).await
}

pub(super) async fn dead_discard(s: Shared, h: HeaderMap, u: Uri, body: Bytes) -> Response {
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
    let changed = attempt!(
        console.clone(),
        headers,
        run(&console, action, &selected.filter)
            .await
            .map_err(Failure::from)
    );
    tracing::info!(
        target: "outbox_runtime::console",
        action = action.verb(),
        rows = changed,
        ids = %selected.rows.iter().map(|r| r.id.as_str()).collect::<Vec<_>>().join(","),
        "console action: {} {changed} row(s)",
        action.verb()
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
) -> std::result::Result<Selected, Failure> {
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
        List::Parked => admin::list_parked(&console.pool, &filter)
            .await?
            .iter()
            .map(Row::parked)
            .collect(),
        List::Dead => admin::list_dead(&console.pool, &filter)
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

async fn run(console: &Console, action: Action, filter: &PoisonFilter) -> crate::Result<u64> {
    match action {
        Action::RetryParked => admin::retry_parked(&console.pool, filter).await,
        Action::SkipParked => admin::drop_parked(&console.pool, filter).await,
        Action::RetryDead => admin::retry_dead(&console.pool, filter).await,
        Action::DiscardDead => admin::discard_dead(&console.pool, filter).await,
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct EventQuery {
    id: Option<String>,
}

pub(super) async fn event(
    State(console): Shared,
    headers: HeaderMap,
    query: Result<Query<EventQuery>, QueryRejection>,
) -> Response {
    let query = attempt!(console.clone(), headers, query_of(query));
    let id = given(&query.id).map(str::to_owned);
    let found = match &id {
        None => None,
        Some(id) => {
            let which: EventRef = attempt!(console.clone(), headers, id.parse().map_err(bad_input));
            Some(attempt!(
                console.clone(),
                headers,
                admin::find_event(&console.pool, which)
                    .await
                    .map_err(Failure::from)
            ))
        }
    };
    let page = Page::new(&console, &headers, Some(warnings(&console).await));
    pages::event(&page, id.as_deref(), found.as_ref().map(Option::as_ref)).into_response()
}

pub(super) async fn css() -> Response {
    asset(
        "text/css; charset=utf-8",
        include_str!("assets/console.css"),
    )
}

pub(super) async fn js() -> Response {
    asset(
        "text/javascript; charset=utf-8",
        include_str!("assets/console.js"),
    )
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        body,
    )
        .into_response()
}

pub(super) async fn not_found(State(console): Shared, headers: HeaderMap) -> Response {
    let page = Page::new(&console, &headers, None);
    let text = "No such page of the outbox console.";
    (
        StatusCode::NOT_FOUND,
        pages::message(&page, "Not found", text),
    )
        .into_response()
}
