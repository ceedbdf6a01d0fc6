//! The pages, as HTML (maud). Each reads without JavaScript; `console.js` adds the refresh of
//! live figures, the confirmation dialogs and "select all".

use std::sync::Arc;

use axum::http::HeaderMap;
use chrono::{DateTime, Utc};
use maud::{html, Markup, DOCTYPE};

use super::chart::{self, Samples};
use super::lists::{Action, List, ListQuery};
use super::{auth, Console};
use crate::admin::{DeadInboxEvent, EventTrace, Health, HeldKey, ParkedEvent, RelayInstance};

/// The health warnings for the top of a page.
pub(super) enum Warnings {
    Checked(Arc<Health>),
    /// The check failed: its error.
    Failed(String),
}

/// What every page needs: the console, whether the request may act, the warnings.
pub(super) struct Page<'a> {
    console: &'a Console,
    signed_in: bool,
    warnings: Option<Warnings>,
}

impl<'a> Page<'a> {
    pub(super) fn new(
        console: &'a Console,
        headers: &HeaderMap,
        warnings: Option<Warnings>,
    ) -> Self {
        Page {
            console,
            signed_in: auth::signed_in(console, headers),
            warnings,
        }
    }

    /// Whether the page offers actions: allowed, and the request carries the token.
    fn actions(&self) -> bool {
        self.console.settings.actions_allowed() && self.signed_in
    }

    fn link(&self, path: &str) -> String {
        self.console.link(path)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Nav {
    Overview,
    Relays,
    Parked,
    Dead,
    Event,
    None,
}

fn layout(page: &Page<'_>, title: &str, nav: Nav, refresh: bool, content: Markup) -> Markup {
    let settings = &page.console.settings;
    let item = |target: Nav, path: &str, label: &str| {
        html! {
            a href=(page.link(path)) class=[(nav == target).then_some("active")] { (label) }
        }
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outbox console" }
                link rel="stylesheet" href=(page.link("/assets/console.css"));
                script src=(page.link("/assets/console.js")) defer {}
            }
            body {
                header {
                    nav {
                        strong { "outbox" }
                        (item(Nav::Overview, "/", "Overview"))
                        (item(Nav::Relays, "/relays", "Relays"))
                        (item(Nav::Parked, "/parked", "Parked"))
                        (item(Nav::Dead, "/dead", "Dead"))
                        (item(Nav::Event, "/event", "Find an event"))
                    }
                    form.find method="get" action=(page.link("/event")) {
                        input type="search" name="id" placeholder="event id or outbox id" aria-label="event id";
                    }
                    div.who {
                        @if !settings.actions_allowed() {
                            span.mode { "read-only" }
                        } @else if page.signed_in {
                            form method="post" action=(page.link("/logout")) {
                                button.link type="submit" { "sign out" }
                            }
                        } @else {
                            a href=(page.link("/login")) { "sign in to act" }
                        }
                    }
                }
                div #page data-refresh=[refresh.then(|| settings.refresh_interval.as_secs())] {
                    (warnings(page))
                    main { (content) }
                    footer {
                        "Read at " (time(Utc::now())) "."
                        @if refresh {
                            " Refreshes every " (settings.refresh_interval.as_secs()) " s."
                        }
                    }
                }
            }
        }
    }
}

fn warnings(page: &Page<'_>) -> Markup {
    html! {
        @match &page.warnings {
            None => {}
            Some(Warnings::Failed(error)) => {
                section.warnings { p { "The health check failed: " (error) } }
            }
            Some(Warnings::Checked(health)) if health.warnings.is_empty() => {
                p.healthy { "No health warnings." }
            }
            Some(Warnings::Checked(health)) => {
                section.warnings #warnings {
                    h2 { (health.warnings.len()) " health warning(s)" }
                    ul {
                        @for w in &health.warnings {
                            li data-kind=(w.kind().as_str()) { strong { (w.kind().as_str()) } ": " (w.to_string()) }
                        }
                    }
                }
            }
        }
    }
}

/// `2026-12-03 11:42:07 UTC`.
fn time(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

fn time_opt(at: Option<DateTime<Utc>>) -> String {
    at.map_or_else(|| "-".to_owned(), time)
}

/// `3 h 4 min`, `4 min 3 s`, `12 s`.
fn age(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{} min {} s", s / 60, s % 60),
        3600..=86_399 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86_400, s % 86_400 / 3600),
    }
}

/// `12,345`.
fn n(v: i64) -> String {
    let digits = v.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if v < 0 {
        out.insert(0, '-');
    }
    out
}

/// A long text: its start, and the whole behind a disclosure.
fn long_text(text: &str, shown: usize) -> Markup {
    let chars = text.chars().count();
    html! {
        @if chars <= shown {
            span.text { (text) }
        } @else {
            details {
                summary { (text.chars().take(shown).collect::<String>()) "…" }
                pre { (text) }
            }
        }
    }
}

/// A payload: one line of compact JSON, and the whole, pretty-printed, behind a disclosure.
fn payload(value: &serde_json::Value) -> Markup {
    let compact = value.to_string();
    let pretty = serde_json::to_string_pretty(value).unwrap_or_else(|_| compact.clone());
    html! {
        details.payload {
            summary { (compact.chars().take(80).collect::<String>()) @if compact.chars().count() > 80 { "…" } }
            pre { (pretty) }
        }
    }
}

pub(super) fn overview(page: &Page<'_>, health: &Health, samples: &Samples) -> Markup {
    let status = &health.status;
    let now = Utc::now();
    let settings = &page.console.settings;
    let series = |f: fn(&chart::Sample) -> f64| -> Vec<(DateTime<Utc>, f64)> {
        samples.iter().map(|s| (s.at, f(s))).collect()
    };
    let content = html! {
        h1 { "Overview" }
        p {
            a href=(page.link("/relays")) { (status.relay_instances) " relay instance(s)" }
            " running on this database; "
            (n(status.processed_event_rows)) " dedup records (about)."
        }
        section.charts {
            @if samples.len() < 2 {
                p.note {
                    "Collecting samples for the charts: this console reads the figures every "
                    (settings.sample_interval.as_secs()) " s since " (time(page.console.started_at))
                    " and keeps the last hour."
                }
            } @else {
                (chart::line_chart("Backlog", "rows", now, &[
                    ("outbox unpublished", "#c0392b", series(|s| s.outbox_backlog)),
                    ("inbox unprocessed", "#2471a3", series(|s| s.inbox_backlog)),
                ]))
                (chart::line_chart("Publish rate", "events/s", now, &[
                    ("published", "#1e8449", series(|s| s.publish_rate)),
                ]))
                p.note {
                    "Sampled by this console every " (settings.sample_interval.as_secs())
                    " s since " (time(page.console.started_at)) "; the publish rate is the last minute's average."
                }
            }
        }
        h2 { "Outbox, by topic" }
        @if status.outbox.is_empty() {
            p.empty { "Nothing unpublished or parked, nothing published in the last minute." }
        } @else {
            table #outbox-topics {
                thead { tr {
                    th { "Topic" } th.num { "Unpublished" } th.num { "Retrying" } th.num { "Held" }
                    th.num { "Parked" } th.num { "Oldest unpublished" } th.num { "Published, last minute" }
                } }
                tbody {
                    @for t in &status.outbox {
                        tr data-topic=(t.topic) {
                            td { (t.topic) }
                            td.num.unpublished { (n(t.unpublished)) }
                            td.num.retrying { (n(t.retrying)) }
                            td.num.held { (n(t.held)) }
                            td.num.parked {
                                @if t.parked > 0 {
                                    a href={ (page.link("/parked")) "?topic=" (urlencode(&t.topic)) } { (n(t.parked)) }
                                } @else { "0" }
                            }
                            td.num.age { (t.oldest_unpublished_age_secs.map_or_else(|| "-".to_owned(), age)) }
                            td.num.published { (n(t.published_last_minute)) }
                        }
                    }
                }
            }
        }
        h2 { "Inbox, by topic" }
        p.note { "Rows that inbox-mode consumers stored in this database, by the topic they were read from." }
        @if status.inbox.is_empty() {
            p.empty { "Nothing unprocessed or dead." }
        } @else {
            table #inbox-topics {
                thead { tr {
                    th { "Topic" } th.num { "Unprocessed" } th.num { "Retrying" } th.num { "Dead" }
                    th.num { "Oldest unprocessed" }
                } }
                tbody {
                    @for t in &status.inbox {
                        tr data-topic=(t.topic) {
                            td { (t.topic) }
                            td.num.unprocessed { (n(t.unprocessed)) }
                            td.num.retrying { (n(t.retrying)) }
                            td.num.dead {
                                @if t.dead > 0 {
                                    a href={ (page.link("/dead")) "?topic=" (urlencode(&t.topic)) } { (n(t.dead)) }
                                } @else { "0" }
                            }
                            td.num.age { (t.oldest_unprocessed_age_secs.map_or_else(|| "-".to_owned(), age)) }
                        }
                    }
                }
            }
        }
    };
    layout(page, "Overview", Nav::Overview, true, content)
}

fn urlencode(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// `0-15, 32, 40-41`.
fn ranges(shards: &[i32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < shards.len() {
        let start = shards[i];
        let mut end = start;
        while i + 1 < shards.len() && shards[i + 1] == end + 1 {
            i += 1;
            end = shards[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    out.join(", ")
}

pub(super) fn relays(
    page: &Page<'_>,
    instances: &[RelayInstance],
    since: &[DateTime<Utc>],
    held: &[HeldKey],
) -> Markup {
    let now = Utc::now();
    let content = html! {
        h1 { "Relays" }
        p.note {
            "Each live relay instance holds a member slot and the shards it publishes (partition keys are spread over 64 shards; one instance publishes a shard at a time, which keeps each key's order)."
        }
        @if instances.is_empty() {
            p.empty #no-relays { "No relay instance is running on this database." }
        } @else {
            table #relay-instances {
                thead { tr {
                    th.num { "Slot" } th.num { "Backend pid" } th { "Application" } th { "Client" }
                    th { "Connected since" } th.num { "Shards" } th { "Which" } th { "Unchanged since" }
                } }
                tbody {
                    @for (i, since) in instances.iter().zip(since) {
                        tr data-pid=(i.pid) {
                            td.num { (i.slot) }
                            td.num { (i.pid) }
                            td { (i.application_name.as_deref().unwrap_or("")) }
                            td { (i.client_addr.as_deref().unwrap_or("local")) }
                            td { (time_opt(i.connected_at)) }
                            td.num.shards { (i.shards.len()) }
                            td.which { (ranges(&i.shards)) }
                            td { (time(*since)) }
                        }
                    }
                }
            }
            p.note { "\"Unchanged since\": as far as this console has seen (it looks when this page is read)." }
        }
        h2 { "Held keys" }
        p.note {
            "Keys whose rows wait for an operator: the broker refused them for a reason only an operator fixes (a missing topic, missing authorization). The relay publishes them once it is fixed."
        }
        @if held.is_empty() {
            p.empty #no-held-keys { "No key is held." }
        } @else {
            table #held-keys {
                thead { tr {
                    th { "Topic" } th { "Key" } th.num { "Rows" } th { "Held since" } th { "Error" }
                } }
                tbody {
                    @for h in held {
                        tr data-topic=(h.topic) {
                            td { (h.topic) }
                            td { (long_text(&h.partition_key, 40)) }
                            td.num { (n(h.rows)) }
                            td { (time(h.held_since)) " (" (age((now - h.held_since).num_milliseconds() as f64 / 1000.0)) ")" }
                            td.error { (long_text(h.last_error.as_deref().unwrap_or(""), 120)) }
                        }
                    }
                }
            }
        }
    };
    layout(page, "Relays", Nav::Relays, true, content)
}

/// A parked or dead row, as the lists and the confirmation show it.
pub(super) struct Row {
    /// The outbox row id, or the inbox row's event id.
    pub(super) id: String,
    event_id: String,
    topic: String,
    key: String,
    event_type: String,
    attempts: i32,
    last_error: String,
    written_at: DateTime<Utc>,
    failed_at: DateTime<Utc>,
    payload: serde_json::Value,
}

impl Row {
    pub(super) fn parked(r: &ParkedEvent) -> Row {
        Row {
            id: r.id.to_string(),
            event_id: r.event_id.to_string(),
            topic: r.topic.clone(),
            key: r.partition_key.clone(),
            event_type: r.event_type.clone(),
            attempts: r.attempts,
            last_error: r.last_error.clone().unwrap_or_default(),
            written_at: r.created_at,
            failed_at: r.parked_at,
            payload: r.payload.clone(),
        }
    }

    pub(super) fn dead(r: &DeadInboxEvent) -> Row {
        Row {
            id: r.event_id.to_string(),
            event_id: r.event_id.to_string(),
            topic: r.topic.clone(),
            key: r.partition_key.clone().unwrap_or_default(),
            event_type: r.event_type.clone(),
            attempts: r.attempts,
            last_error: r.last_error.clone().unwrap_or_default(),
            written_at: r.received_at,
            failed_at: r.dead_at,
            payload: r.payload.clone(),
        }
    }
}

/// What the redirect after an action says it did (`retried:3`).
fn done_message(done: &str) -> Option<String> {
    let (verb, count) = done.split_once(':')?;
    let count: u64 = count.parse().ok()?;
    let verb = match verb {
        "retried" => "Retried",
        "skipped" => "Skipped (deleted)",
        "discarded" => "Discarded",
        _ => return None,
    };
    Some(format!("{verb} {count} row(s)."))
}

pub(super) fn poison_list(
    page: &Page<'_>,
    list: List,
    query: &ListQuery,
    rows: &[Row],
    total: i64,
    cap: u32,
    next: Option<String>,
) -> Markup {
    let (title, what, written, failed, actions) = match list {
        List::Parked => (
            "Parked outbox rows",
            "Rows the broker refused too often: the relay skips them until an operator retries them (after fixing the cause) or skips them for good. A parked row does not hold its key: later events of the key were published meanwhile.",
            "Written",
            "Parked",
            [(Action::RetryParked, "Retry"), (Action::SkipParked, "Skip")],
        ),
        List::Dead => (
            "Dead inbox rows",
            "Inbox rows whose handler failed for good or too often: processors skip them until an operator retries them (the handler runs again) or discards them (never handled; still a dedup record).",
            "Received",
            "Dead",
            [(Action::RetryDead, "Retry"), (Action::DiscardDead, "Discard")],
        ),
    };
    let count = if total > i64::from(cap) {
        format!("{}+ rows match", n(i64::from(cap)))
    } else {
        format!("{} row(s) match", n(total))
    };
    let filtered = !query.filter_query().is_empty();
    let form_id = "selection";
    let table = html! {
        table #rows {
            thead { tr {
                @if page.actions() {
                    th { input type="checkbox" .select-all aria-label="select all on this page"; }
                    th { "Act" }
                }
                @if list == List::Parked { th.num { "Id" } }
                th { "Event id" } th { "Topic" } th { "Key" } th { "Type" } th.num { "Attempts" }
                th { (written) } th { (failed) } th { "Last error" } th { "Payload" }
            } }
            tbody {
                @for r in rows {
                    tr data-id=(r.id) {
                        @if page.actions() {
                            td { input type="checkbox" name="id" value=(r.id) form=(form_id) aria-label="select"; }
                            td.act {
                                @for (action, label) in actions {
                                    button type="submit" form=(form_id) name="only" value=(r.id)
                                        formaction=(page.link(action.path()))
                                        data-confirm=(action.question(1))
                                        class={ "act-" (action.verb()) } { (label) }
                                }
                            }
                        }
                        @if list == List::Parked { td.num { (r.id) } }
                        td { a href={ (page.link("/event")) "?id=" (r.event_id) } title=(r.event_id) { code { (r.event_id.get(..8).unwrap_or(&r.event_id)) "…" } } }
                        td { (r.topic) }
                        td { (long_text(&r.key, 24)) }
                        td { (r.event_type) }
                        td.num { (r.attempts) }
                        td.time { (time(r.written_at)) }
                        td.time { (time(r.failed_at)) }
                        td.error { (long_text(&r.last_error, 80)) }
                        td { (payload(&r.payload)) }
                    }
                }
            }
        }
    };
    let content = html! {
        h1 { (title) }
        p.note { (what) }
        @if let Some(message) = query.done.as_deref().and_then(done_message) {
            p.done #done { (message) }
        }
        form.filter method="get" action=(page.link(list.path())) {
            label { "Topic " input type="text" name="topic" value=[query.topic.as_deref()]; }
            label { "Type " input type="text" name="type" value=[query.event_type.as_deref()]; }
            label { (written) " since (UTC) " input type="datetime-local" name="since" value=[query.since.as_deref()]; }
            label { "until " input type="datetime-local" name="until" value=[query.until.as_deref()]; }
            button type="submit" { "Filter" }
            @if filtered { " " a href=(page.link(list.path())) { "clear" } }
        }
        p #count { (count) @if query.after.is_some() { " · a later page" } }
        @if rows.is_empty() {
            p.empty #no-rows { "No rows here." }
        } @else {
            @if page.actions() {
                form #(form_id) method="post" action=(page.link(actions[0].0.path())) {
                    input type="hidden" name="form_key" value=(page.console.form_key);
                    input type="hidden" name="confirmed" value="0";
                    input type="hidden" name="back" value=(query.filter_query());
                    @for (action, label) in actions {
                        button type="submit" formaction=(page.link(action.path()))
                            data-confirm-selected=(action.question(0))
                            class={ "bulk-" (action.verb()) } { (label) " selected" }
                        " "
                    }
                }
            } @else if page.console.settings.actions_allowed() {
                p.note {
                    a href={ (page.link("/login")) "?next=" (urlencode(&page.link(list.path()))) } { "Sign in" }
                    @match list {
                        List::Parked => " to retry or skip rows.",
                        List::Dead => " to retry or discard rows.",
                    }
                }
            }
            (table)
        }
        nav.pages {
            @if query.after.is_some() {
                a href={ (page.link(list.path())) @if filtered { "?" (query.filter_query()) } } { "« first page" }
                " "
            }
            @if let Some(next) = next { a #next href=(next) { "next page »" } }
        }
    };
    let nav = match list {
        List::Parked => Nav::Parked,
        List::Dead => Nav::Dead,
    };
    layout(page, title, nav, false, content)
}

pub(super) fn confirm(page: &Page<'_>, action: Action, rows: &[Row], back: &str) -> Markup {
    let content = html! {
        h1 { "Confirm" }
        p.question { (action.question(rows.len())) }
        table #rows {
            thead { tr { th { "Row" } th { "Topic" } th { "Type" } th { "Attempts" } th { "Last error" } } }
            tbody {
                @for r in rows {
                    tr data-id=(r.id) {
                        td { code { (r.id) } } td { (r.topic) } td { (r.event_type) }
                        td.num { (r.attempts) } td.error { (long_text(&r.last_error, 80)) }
                    }
                }
            }
        }
        form method="post" action=(page.link(action.path())) {
            input type="hidden" name="form_key" value=(page.console.form_key);
            input type="hidden" name="confirmed" value="1";
            input type="hidden" name="back" value=(back);
            @for r in rows { input type="hidden" name="id" value=(r.id); }
            button #confirm type="submit" { "Yes, " (action.word()) " " (rows.len()) " row(s)" }
            " "
            a href={ (page.link(action.list().path())) @if !back.is_empty() { "?" (back) } } { "Cancel" }
        }
    };
    layout(page, "Confirm", Nav::None, false, content)
}

pub(super) fn event(
    page: &Page<'_>,
    id: Option<&str>,
    found: Option<Option<&EventTrace>>,
) -> Markup {
    let content = html! {
        h1 { "Find an event" }
        form.filter method="get" action=(page.link("/event")) {
            label { "Event id or outbox row id " input type="search" name="id" value=[id] size="40"; }
            button type="submit" { "Find" }
        }
        @match found {
            None => { p.note { "An event id (a UUID) finds its outbox row, inbox row and dedup records; a number finds the outbox row with that id." } }
            Some(None) => { p.empty #not-found { "No outbox row has id " (id.unwrap_or("")) "." } }
            Some(Some(trace)) if trace.is_empty() => {
                p.empty #not-found {
                    "Nothing in this database holds event " code { (trace.event_id) }
                    ": it never passed through here, or retention removed its rows."
                }
            }
            Some(Some(trace)) => { (event_trace(page, trace)) }
        }
    };
    layout(page, "Find an event", Nav::Event, false, content)
}

fn event_trace(page: &Page<'_>, trace: &EventTrace) -> Markup {
    html! {
        h2 { "Event " code { (trace.event_id) } }
        ul #where-now {
            @if let Some(o) = &trace.outbox {
                li #outbox-state {
                    @if let Some(at) = o.published_at { "Outbox: published at " (time(at)) "." }
                    @else if let Some(at) = o.parked_at {
                        "Outbox: parked since " (time(at)) " after " (o.attempts) " attempt(s). "
                        a href={ (page.link("/parked")) "?topic=" (urlencode(&o.topic)) } { "Parked rows" }
                    }
                    @else if let Some(at) = o.held_at { "Outbox: held since " (time(at)) " (an operator's problem: see Relays)." }
                    @else if o.next_attempt_at.is_some() { "Outbox: waiting for a retry (" (o.attempts) " refused attempt(s))." }
                    @else { "Outbox: waiting to be published." }
                }
            }
            @if let Some(i) = &trace.inbox {
                li #inbox-state {
                    @if i.processed { "Inbox: processed at " (time_opt(i.processed_at)) "." }
                    @else if let Some(at) = i.dead_at { "Inbox: dead since " (time(at)) " after " (i.attempts) " attempt(s)." }
                    @else { "Inbox: waiting to be processed (" (i.attempts) " failed attempt(s))." }
                }
            }
            @for d in &trace.processed {
                li.dedup { "Handled by " code { (d.handler) } " (dedup mode) at " (time(d.processed_at)) "." }
            }
        }
        @if let Some(o) = &trace.outbox {
            h3 { "Outbox row " (o.id) }
            dl #outbox-row {
                dt { "Topic / key" } dd { (o.topic) " / " (o.partition_key) }
                dt { "Aggregate" } dd { (o.aggregate_type) " " (o.aggregate_id) }
                dt { "Type" } dd { (o.event_type) }
                dt { "Written" } dd { (time(o.created_at)) }
                dt { "Published" } dd.published { (time_opt(o.published_at)) }
                dt { "Attempts" } dd.attempts { (o.attempts) }
                dt { "Last error" } dd { (o.last_error.as_deref().unwrap_or("-")) }
                dt { "Next attempt" } dd { (time_opt(o.next_attempt_at)) }
                dt { "Held since" } dd { (time_opt(o.held_at)) }
                dt { "Parked" } dd { (time_opt(o.parked_at)) }
                dt { "Headers" } dd { (payload(&o.headers)) }
                dt { "Payload" } dd { (payload(&o.payload)) }
            }
        }
        @if let Some(i) = &trace.inbox {
            h3 { "Inbox row" }
            dl #inbox-row {
                dt { "Topic / key" } dd { (i.topic) " / " (i.partition_key.as_deref().unwrap_or("-")) }
                dt { "Read from" } dd { (i.source.map_or_else(|| "-".to_owned(), |(p, o)| format!("partition {p}, offset {o}"))) }
                dt { "Type" } dd { (i.event_type) }
                dt { "Received" } dd { (time(i.received_at)) }
                dt { "Processed" } dd.processed { (time_opt(i.processed_at)) }
                dt { "Attempts" } dd { (i.attempts) }
                dt { "Last error" } dd { (i.last_error.as_deref().unwrap_or("-")) }
                dt { "Dead" } dd { (time_opt(i.dead_at)) }
                dt { "Headers" } dd { (payload(&i.headers)) }
                dt { "Payload" } dd { (payload(&i.payload)) }
            }
        }
    }
}

pub(super) fn login(page: &Page<'_>, next: &str, failure: Option<&str>) -> Markup {
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

pub(super) fn message(page: &Page<'_>, title: &str, text: &str) -> Markup {
    message_back(page, title, text, &page.link("/"))
}

pub(super) fn message_back(page: &Page<'_>, title: &str, text: &str, back: &str) -> Markup {
    let content = html! {
        h1 { (title) }
        p #message { (text) }
        p { a href=(back) { "Back" } }
    };
    layout(page, title, Nav::None, false, content)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_read_as_an_operator_reads_them() {
        assert_eq!(n(0), "0");
        assert_eq!(n(999), "999");
        assert_eq!(n(1000), "1,000");
        assert_eq!(n(1_234_567), "1,234,567");
        assert_eq!(n(-1000), "-1,000");
        assert_eq!(age(4.4), "4 s");
        assert_eq!(age(243.0), "4 min 3 s");
        assert_eq!(age(3.0 * 3600.0 + 240.0), "3 h 4 min");
        assert_eq!(ranges(&[0, 1, 2, 3, 7, 9, 10]), "0-3, 7, 9-10");
        assert_eq!(ranges(&[]), "");
        assert_eq!(
            done_message("retried:3").as_deref(),
            Some("Retried 3 row(s).")
        );
        assert_eq!(done_message("<b>:3"), None);
    }
}
