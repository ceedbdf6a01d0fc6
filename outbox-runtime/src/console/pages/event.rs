//! Find an event: its outbox row, inbox row and dedup records.

use maud::{html, Markup};

use chrono::{DateTime, Utc};

use super::format::{count, n, payload, size, time, time_opt, urlencode};
use super::frame::{layout, Nav, Page};
use crate::admin::{EventTrace, InboxRow, OutboxRow};

/// Payloads up to this size (as JSON) are shown on the page; a larger one on request.
const SHOWN_INLINE: i64 = 32 * 1024;

/// A payload on the event page: its size, and itself if it is small; a large one behind a link
/// to it whole (`of`: `outbox` or `inbox`, the row it is read from).
fn payload_field(
    page: &Page<'_>,
    value: &serde_json::Value,
    bytes: i64,
    id: &str,
    of: &str,
) -> Markup {
    html! {
        span.payload-size {
            (n(bytes)) " bytes as JSON"
            @if bytes >= 1000 { " (" (size(bytes)) ")" }
        }
        @if bytes <= SHOWN_INLINE {
            (payload(value))
        } @else {
            " · too large to show here: "
            a.payload-whole href={ (page.link("/event/payload")) "?id=" (urlencode(id)) "&of=" (of) } {
                "open the payload"
            }
        }
    }
}

pub(in crate::console) fn event(
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

/// "Last error", or, for a row retried by an operator with no attempt failed since, what its
/// last error is: the one before the retry.
fn error_label(retried: bool, attempts: i32) -> &'static str {
    if retried && attempts == 0 {
        "Last error (before the retry)"
    } else {
        "Last error"
    }
}

/// " Retried at … (by …)": a row an operator retried says so, whatever its state since.
fn retried(at: Option<DateTime<Utc>>, by: Option<&str>) -> Markup {
    html! {
        @if let Some(at) = at {
            " Retried at " (time(at)) " (" (by.unwrap_or("an operator")) ")."
        }
    }
}

/// Where the event's outbox row is now.
fn outbox_state(page: &Page<'_>, o: &OutboxRow) -> Markup {
    let by = o.retried_by.as_deref();
    let refused = |n: i32| count(i64::from(n), "refused attempt", "refused attempts");
    html! {
        @if let Some(at) = o.published_at {
            "Outbox: published at " (time(at)) "." (retried(o.retried_at, by))
        } @else if let Some(at) = o.parked_at {
            "Outbox: parked since " (time(at)) " after " (refused(o.attempts)) ". "
            a href={ (page.link("/parked")) "?topic=" (urlencode(&o.topic)) } { "Parked rows" }
            (retried(o.retried_at, by))
        } @else if let Some(at) = o.held_at {
            "Outbox: held since " (time(at)) " (an operator's problem: see Relays)."
        } @else if let (Some(_), 0) = (o.retried_at, o.attempts) {
            "Outbox: waiting to be published (no attempt yet since its retry)." (retried(o.retried_at, by))
        } @else if o.next_attempt_at.is_some() {
            "Outbox: waiting for a retry (" (refused(o.attempts))
            @if o.retried_at.is_some() { " since an operator's retry" }
            ")." (retried(o.retried_at, by))
        } @else {
            "Outbox: waiting to be published."
        }
    }
}

/// Where the event's inbox row is now.
fn inbox_state(i: &InboxRow) -> Markup {
    let by = i.retried_by.as_deref();
    let failed = |n: i32| count(i64::from(n), "failed attempt", "failed attempts");
    html! {
        @if i.processed {
            "Inbox: processed at " (time_opt(i.processed_at)) "." (retried(i.retried_at, by))
        } @else if let Some(at) = i.dead_at {
            "Inbox: dead since " (time(at)) " after " (failed(i.attempts)) "." (retried(i.retried_at, by))
        } @else if let (Some(_), 0) = (i.retried_at, i.attempts) {
            "Inbox: waiting to be processed (no attempt yet since its retry)." (retried(i.retried_at, by))
        } @else {
            "Inbox: waiting to be processed (" (failed(i.attempts)) ")." (retried(i.retried_at, by))
        }
    }
}

fn event_trace(page: &Page<'_>, trace: &EventTrace) -> Markup {
    html! {
        h2 { "Event " code { (trace.event_id) } }
        ul #where-now {
            @if let Some(o) = &trace.outbox {
                li #outbox-state { (outbox_state(page, o)) }
            }
            @if let Some(i) = &trace.inbox {
                li #inbox-state { (inbox_state(i)) }
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
                dt { (error_label(o.retried_at.is_some(), o.attempts)) } dd.last-error { (o.last_error.as_deref().unwrap_or("-")) }
                dt { "Next attempt" } dd { (time_opt(o.next_attempt_at)) }
                dt { "Held since" } dd { (time_opt(o.held_at)) }
                dt { "Parked" } dd { (time_opt(o.parked_at)) }
                @if let Some(at) = o.retried_at {
                    dt { "Retried" } dd.retried { (time(at)) ", by " (o.retried_by.as_deref().unwrap_or("an operator")) }
                }
                dt { "Headers" } dd { (payload(&o.headers)) }
                dt { "Payload" } dd { (payload_field(page, &o.payload, o.payload_bytes, &o.id.to_string(), "outbox")) }
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
                dt { (error_label(i.retried_at.is_some(), i.attempts)) } dd.last-error { (i.last_error.as_deref().unwrap_or("-")) }
                dt { "Dead" } dd { (time_opt(i.dead_at)) }
                @if let Some(at) = i.retried_at {
                    dt { "Retried" } dd.retried { (time(at)) ", by " (i.retried_by.as_deref().unwrap_or("an operator")) }
                }
                dt { "Headers" } dd { (payload(&i.headers)) }
                dt { "Payload" } dd { (payload_field(page, &i.payload, i.payload_bytes, &trace.event_id.to_string(), "inbox")) }
            }
        }
    }
}
