//! The pages that read: the overview, the relays, the parked and dead lists, an event; and
//! the page for an unknown path.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use uuid::Uuid;

use crate::admin::{self, EventRef, PayloadOf};
use crate::console::lists::{given, parse_time, List, ListQuery};
use crate::console::pages::{self, Page, Row};
use crate::console::respond::{
    attempt, bad_input, query_of, warnings, with_query, ErrorPage, Shared,
};

/// Counts of matching rows stop here: "10,000+" needs no scan of a million rows.
const COUNT_CAP: u32 = 10_000;

pub(in crate::console) async fn overview(State(console): Shared, headers: HeaderMap) -> Response {
    console.start_sampler();
    let health = attempt!(
        console.clone(),
        headers,
        console.latest_health().await.map_err(ErrorPage::from)
    );
    let page = Page::new(
        &console,
        &headers,
        Some(pages::Warnings::Checked(health.clone())),
    );
    let queues = match &console.settings.queues {
        Some(source) => Some(source.read(&health.status).await),
        None => None,
    };
    let samples = console.samples.lock().expect("samples");
    pages::overview(&page, &health, &samples, queues.as_ref()).into_response()
}

pub(in crate::console) async fn relays(State(console): Shared, headers: HeaderMap) -> Response {
    console.start_sampler();
    let read = async {
        let instances = admin::relay_instances(&console.pool).await?;
        let held = admin::held_keys(&console.pool, 200).await?;
        Ok::<_, crate::Error>((instances, held))
    };
    let (instances, held) = attempt!(
        console.clone(),
        headers,
        read.await.map_err(ErrorPage::from)
    );
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

pub(in crate::console) async fn parked(
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
        let mut rows = admin::list_parked_summaries(&console.pool, &page_filter).await?;
        let total = admin::count_parked(&console.pool, &filter.limit(COUNT_CAP + 1)).await?;
        let next = (rows.len() > console.settings.page_size as usize).then(|| {
            rows.truncate(console.settings.page_size as usize);
            let last = rows.last().expect("a full page").id;
            let mut q = query.filter_query();
            q.push_str(if q.is_empty() { "" } else { "&" });
            q.push_str(&format!("after={last}"));
            with_query(console.link("/parked"), &q)
        });
        Ok::<_, ErrorPage>((rows, total, next))
    };
    let (rows, total, next) = attempt!(console.clone(), headers, read.await);
    let rows: Vec<Row> = rows.iter().map(Row::parked).collect();
    let page = Page::new(&console, &headers, Some(warnings(&console).await));
    pages::poison_list(&page, List::Parked, &query, &rows, total, COUNT_CAP, next).into_response()
}

pub(in crate::console) async fn dead(
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
        let mut rows = admin::list_dead_summaries(&console.pool, &page_filter).await?;
        let total = admin::count_dead(&console.pool, &filter.limit(COUNT_CAP + 1)).await?;
        let next = (rows.len() > console.settings.page_size as usize).then(|| {
            rows.truncate(console.settings.page_size as usize);
            let last = rows.last().expect("a full page");
            let mut q = form_urlencoded::Serializer::new(query.filter_query());
            q.append_pair("after", &last.received_at.to_rfc3339());
            q.append_pair("after_id", &last.event_id.to_string());
            with_query(console.link("/dead"), &q.finish())
        });
        Ok::<_, ErrorPage>((rows, total, next))
    };
    let (rows, total, next) = attempt!(console.clone(), headers, read.await);
    let rows: Vec<Row> = rows.iter().map(Row::dead).collect();
    let page = Page::new(&console, &headers, Some(warnings(&console).await));
    pages::poison_list(&page, List::Dead, &query, &rows, total, COUNT_CAP, next).into_response()
}

#[derive(Debug, Deserialize)]
pub(in crate::console) struct EventQuery {
    id: Option<String>,
}

pub(in crate::console) async fn event(
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
                    .map_err(ErrorPage::from)
            ))
        }
    };
    let page = Page::new(&console, &headers, Some(warnings(&console).await));
    pages::event(&page, id.as_deref(), found.as_ref().map(Option::as_ref)).into_response()
}

#[derive(Debug, Deserialize)]
pub(in crate::console) struct PayloadQuery {
    id: Option<String>,
    of: Option<String>,
}

/// An event's payload, whole, as the relay sends it: what the event page links to when the
/// payload is too large to show.
pub(in crate::console) async fn event_payload(
    State(console): Shared,
    headers: HeaderMap,
    query: Result<Query<PayloadQuery>, QueryRejection>,
) -> Response {
    let query = attempt!(console.clone(), headers, query_of(query));
    let which: EventRef = attempt!(
        console.clone(),
        headers,
        given(&query.id)
            .unwrap_or_default()
            .parse()
            .map_err(bad_input)
    );
    let of = match given(&query.of) {
        Some("outbox") | None => PayloadOf::Outbox,
        Some("inbox") => PayloadOf::Inbox,
        Some(other) => {
            let failure = bad_input(format!("`of`: `{other}` is neither `outbox` nor `inbox`"));
            return crate::console::respond::fail(console, headers, failure).await;
        }
    };
    let text = attempt!(
        console.clone(),
        headers,
        admin::payload_text(&console.pool, which, of)
            .await
            .map_err(ErrorPage::from)
    );
    match text {
        Some(text) => (
            [(header::CONTENT_TYPE, "application/json; charset=utf-8")],
            text,
        )
            .into_response(),
        None => not_found(State(console), headers).await,
    }
}

pub(in crate::console) async fn not_found(State(console): Shared, headers: HeaderMap) -> Response {
    let page = Page::new(&console, &headers, None);
    let text = "No such page of the outbox console.";
    (
        StatusCode::NOT_FOUND,
        pages::message(&page, "Not found", text),
    )
        .into_response()
}
