//! The parked and dead lists (a page of rows, the filter, the actions' buttons), and the
//! confirmation an action asks for.

use chrono::{DateTime, Utc};
use maud::{html, Markup};

use super::format::{count, minute, n, payload_summary, time, urlencode};
use super::frame::{layout, Nav, Page};
use crate::admin::{DeadInboxEventSummary, ParkedEventSummary, PayloadSummary};
use crate::console::lists::{Action, List, ListQuery};

/// A parked or dead row, as the lists and the confirmation show it.
pub(in crate::console) struct Row {
    /// The outbox row id, or the inbox row's event id.
    pub(in crate::console) id: String,
    event_id: String,
    topic: String,
    key: String,
    event_type: String,
    attempts: i32,
    last_error: String,
    written_at: DateTime<Utc>,
    failed_at: DateTime<Utc>,
    payload: PayloadSummary,
}

impl Row {
    pub(in crate::console) fn parked(r: &ParkedEventSummary) -> Row {
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

    pub(in crate::console) fn dead(r: &DeadInboxEventSummary) -> Row {
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
    let (verb, count_of) = done.split_once(':')?;
    let count_of: u64 = count_of.parse().ok()?;
    let verb = match verb {
        "retried" => "Retried",
        "skipped" => "Skipped (deleted)",
        "discarded" => "Discarded",
        _ => return None,
    };
    Some(format!("{verb} {}.", count(count_of as i64, "row", "rows")))
}

pub(in crate::console) fn poison_list(
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
    let matching = if total > i64::from(cap) {
        format!("{}+ rows match", n(i64::from(cap)))
    } else if total == 1 {
        "1 row matches".to_owned()
    } else {
        format!("{} rows match", n(total))
    };
    let filtered = !query.filter_query().is_empty();
    let form_id = "selection";
    // One line a row: long values cut, whole in their title and on the event page.
    let table = html! {
        table #rows .list {
            thead { tr {
                @if page.actions() {
                    th.c-select { input type="checkbox" .select-all aria-label="select all on this page"; }
                    th.c-act.wide { "Act" }
                }
                @match list {
                    List::Parked => th.c-id.num title="The outbox row's id: its event page" { "Id" },
                    List::Dead => th.c-event title="The event's id: its event page" { "Event id" },
                }
                th.c-topic { "Topic" } th.c-key { "Key" } th.c-type { "Type" }
                th.c-attempts.num title="Attempts: publish attempts the broker refused, or handler runs that failed" { "Tries" }
                th.c-time.wide { (written) " (UTC)" } th.c-time { (failed) " (UTC)" }
                th.c-payload { "Payload" } th.c-error { "Last error" }
            } }
            tbody {
                @for r in rows {
                    tr data-id=(r.id) {
                        @if page.actions() {
                            td { input type="checkbox" name="id" value=(r.id) form=(form_id) aria-label="select"; }
                            td.act.wide {
                                @for (action, label) in actions {
                                    button type="submit" form=(form_id) name="only" value=(r.id)
                                        formaction=(page.link(action.path()))
                                        data-confirm=(action.question(1))
                                        class={ "act-" (action.verb()) } { (label) }
                                }
                            }
                        }
                        @match list {
                            List::Parked => td.num.id { a href={ (page.link("/event")) "?id=" (r.id) } title={ "event " (r.event_id) } { (r.id) } },
                            List::Dead => td.event { a href={ (page.link("/event")) "?id=" (r.event_id) } title=(r.event_id) { code { (r.event_id.get(..8).unwrap_or(&r.event_id)) "…" } } },
                        }
                        td.topic title=(r.topic) { (r.topic) }
                        td.key title=(r.key) { (r.key) }
                        td.type title=(r.event_type) { (r.event_type) }
                        td.num { (r.attempts) }
                        td.time.wide title=(time(r.written_at)) { (minute(r.written_at)) }
                        td.time title=(time(r.failed_at)) { (minute(r.failed_at)) }
                        td.payload { (payload_summary(&r.payload)) }
                        td.error title=(r.last_error) { (r.last_error) }
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
        p #count { (matching) @if query.after.is_some() { " · a later page" } }
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
                            data-confirm-one=(action.question(1))
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

pub(in crate::console) fn confirm(
    page: &Page<'_>,
    action: Action,
    rows: &[Row],
    back: &str,
) -> Markup {
    let content = html! {
        h1 { "Confirm" }
        p.question { (action.question(rows.len())) }
        table #rows .list .confirm {
            thead { tr {
                th.c-row { "Row" } th.c-topic { "Topic" } th.c-key { "Key" } th.c-type { "Type" }
                th.c-attempts.num title="Attempts" { "Tries" } th.c-payload { "Payload" } th.c-error { "Last error" }
            } }
            tbody {
                @for r in rows {
                    tr data-id=(r.id) {
                        td.row title=(r.id) { code { (r.id) } }
                        td.topic title=(r.topic) { (r.topic) }
                        td.key title=(r.key) { (r.key) }
                        td.type title=(r.event_type) { (r.event_type) }
                        td.num { (r.attempts) }
                        td.payload { (payload_summary(&r.payload)) }
                        td.error title=(r.last_error) { (r.last_error) }
                    }
                }
            }
        }
        form method="post" action=(page.link(action.path())) {
            input type="hidden" name="form_key" value=(page.console.form_key);
            input type="hidden" name="confirmed" value="1";
            input type="hidden" name="back" value=(back);
            @for r in rows { input type="hidden" name="id" value=(r.id); }
            button #confirm type="submit" { "Yes, " (action.word()) " " (count(rows.len() as i64, "row", "rows")) }
            " "
            a href={ (page.link(action.list().path())) @if !back.is_empty() { "?" (back) } } { "Cancel" }
        }
    };
    layout(page, "Confirm", Nav::None, false, content)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_done_message_says_only_what_an_action_did() {
        assert_eq!(
            done_message("retried:3").as_deref(),
            Some("Retried 3 rows.")
        );
        assert_eq!(done_message("retried:1").as_deref(), Some("Retried 1 row."));
        assert_eq!(done_message("<b>:3"), None);
    }
}
