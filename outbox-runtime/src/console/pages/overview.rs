//! The overview: the backlog by topic, outbox and inbox, and the charts.

use chrono::{DateTime, Utc};
use maud::{html, Markup};

use std::sync::atomic::Ordering;

use super::format::{age, clock, count, interval, n, time, urlencode};
use super::frame::{layout, Nav, Page};
use crate::admin::Health;
use crate::console::chart::{self, Samples};
use crate::console::queues::BrokerQueues;

pub(in crate::console) fn overview(
    page: &Page<'_>,
    health: &Health,
    samples: &Samples,
    queues: Option<&BrokerQueues>,
) -> Markup {
    let status = &health.status;
    let now = Utc::now();
    let settings = &page.console.settings;
    let series = |f: fn(&chart::Sample) -> f64| -> Vec<(DateTime<Utc>, f64)> {
        samples.iter().map(|s| (s.at, f(s))).collect()
    };
    let every = interval(settings.sample_interval);
    let start = chart::axis_start(now, samples);
    // Why a chart has nothing to draw, if it has not.
    let empty = |nothing: String, zeros: bool| match samples.first() {
        None if !page.console.sampling.load(Ordering::Relaxed) => Some(
            "No samples: this console is not served on a tokio runtime, which its sampler needs."
                .to_owned(),
        ),
        None => Some(format!("No sample yet: the first comes within {every}.")),
        Some(first) if samples.len() == 1 => Some(format!(
            "One sample so far, at {} UTC: a line needs two; the next in {every}.",
            clock(first.at)
        )),
        Some(_) if zeros => Some(nothing),
        Some(_) => None,
    };
    let backlog = chart::Chart {
        title: "Backlog",
        class: "backlog",
        unit: "rows",
        series: vec![
            ("outbox unpublished", "#c0392b", series(|s| s.outbox_backlog)),
            ("inbox unprocessed", "#2471a3", series(|s| s.inbox_backlog)),
        ],
        empty: empty(
            format!(
                "No backlog since {} UTC: at every sample, every event was published and every inbox row processed.",
                clock(start)
            ),
            samples.iter().all(|s| s.outbox_backlog == 0.0 && s.inbox_backlog == 0.0),
        ),
    };
    let rate = chart::Chart {
        title: "Publish rate",
        class: "publish-rate",
        unit: "events/s",
        series: vec![("published", "#1e8449", series(|s| s.publish_rate))],
        empty: empty(
            format!("Nothing was published since {} UTC.", clock(start)),
            samples.iter().all(|s| s.publish_rate == 0.0),
        ),
    };
    let content = html! {
        h1 { "Overview" }
        p {
            a href=(page.link("/relays")) { (count(status.relay_instances, "relay instance", "relay instances")) }
            " running on this database; "
            (count(status.processed_event_rows, "dedup record", "dedup records")) " (about)."
        }
        section.charts {
            (chart::line_chart(&backlog, start, now))
            (chart::line_chart(&rate, start, now))
            p.note {
                @if samples.first().is_some() && !chart::full_window(now, start) {
                    "The charts start at this console's first sample, " (time(start)) " ("
                    (age((now - start).num_milliseconds() as f64 / 1000.0)) " ago), and span the last hour once it has one. "
                } @else {
                    "The last hour. "
                }
                "This console samples the figures every " (every) " (since " (time(page.console.started_at))
                "); the publish rate is the last minute's average."
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
        @if let Some(queues) = queues {
            (broker_queues(queues))
        }
    };
    layout(page, "Overview", Nav::Overview, true, content)
}

/// The broker's queues: each group's shard queues, their delay queues, the dead letters.
fn broker_queues(queues: &BrokerQueues) -> Markup {
    let number = |n: Option<u32>| n.map_or_else(|| "-".to_owned(), |n| n.to_string());
    html! {
        h2 { "Broker queues" }
        p.note {
            (queues.title) ": each consumer group's shard queues (one consumer of a group reads a "
            "shard at a time), the delay queues where retries wait, and the dead letters."
        }
        @match &queues.rows {
            Err(e) => p.error #broker-queues-error { "The queues could not be read: " (e) },
            Ok(rows) if rows.is_empty() => p.empty { "No topic to show: the figures name none." },
            Ok(rows) => table #broker-queues {
                thead { tr {
                    th { "Topic" } th { "Group" } th { "Queue" } th { "Kind" }
                    th.num { "Ready" } th.num { "Consumers" } th { "State" }
                } }
                tbody {
                    @for q in rows {
                        tr data-queue=(q.queue) class=(q.state.replace(' ', "-")) {
                            td { (q.topic) } td { (q.group) } td { (q.queue) } td { (q.kind) }
                            td.num.ready { (number(q.messages)) }
                            td.num.consumers { (number(q.consumers)) }
                            td.state { (q.state) }
                        }
                    }
                }
            },
        }
    }
}
