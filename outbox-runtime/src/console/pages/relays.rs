//! The relays page: the live relay instances and their shards, and the held keys.

use chrono::{DateTime, Utc};
use maud::{html, Markup};

use super::format::{age, minute, n, time, time_opt};
use super::frame::{layout, Nav, Page};
use crate::admin::{HeldKey, RelayInstance};

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

pub(in crate::console) fn relays(
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
            table #held-keys .list {
                thead { tr {
                    th.c-topic { "Topic" } th.c-key { "Key" } th.c-rows.num { "Rows" }
                    th.c-since { "Held since (UTC)" } th.c-error { "Error" }
                } }
                tbody {
                    @for h in held {
                        tr data-topic=(h.topic) {
                            td.topic title=(h.topic) { (h.topic) }
                            td.key title=(h.partition_key) { (h.partition_key) }
                            td.num { (n(h.rows)) }
                            td title=(time(h.held_since)) { (minute(h.held_since)) " (" (age((now - h.held_since).num_milliseconds() as f64 / 1000.0)) ")" }
                            td.error.wrap title=[h.last_error.as_deref()] { (h.last_error.as_deref().unwrap_or("")) }
                        }
                    }
                }
            }
        }
    };
    layout(page, "Relays", Nav::Relays, true, content)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_read_as_ranges() {
        assert_eq!(ranges(&[0, 1, 2, 3, 7, 9, 10]), "0-3, 7, 9-10");
        assert_eq!(ranges(&[]), "");
    }
}
