//! The overview: the backlog by topic, outbox and inbox, and the charts.

use chrono::{DateTime, Utc};
use maud::{html, Markup};

use super::format::{age, n, time, urlencode};
use super::frame::{layout, Nav, Page};
use crate::admin::Health;
use crate::console::chart::{self, Samples};

pub(in crate::console) fn overview(page: &Page<'_>, health: &Health, samples: &Samples) -> Markup {
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
