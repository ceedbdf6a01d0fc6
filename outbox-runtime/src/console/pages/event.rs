//! Find an event: its outbox row, inbox row and dedup records.

use maud::{html, Markup};

use super::format::{n, payload, size, time, time_opt, urlencode};
use super::frame::{layout, Nav, Page};
use crate::admin::EventTrace;

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
                dt { "Last error" } dd { (i.last_error.as_deref().unwrap_or("-")) }
                dt { "Dead" } dd { (time_opt(i.dead_at)) }
                dt { "Headers" } dd { (payload(&i.headers)) }
                dt { "Payload" } dd { (payload_field(page, &i.payload, i.payload_bytes, &trace.event_id.to_string(), "inbox")) }
            }
        }
    }
}
