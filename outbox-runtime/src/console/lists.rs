//! What a list page is: which list (parked or dead rows), its query (the filter, the page's
//! cursor), and the actions on its rows.

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::Deserialize;

use super::pages::count;
use crate::admin::PoisonFilter;

/// Which list of poison rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum List {
    Parked,
    Dead,
}

impl List {
    pub(super) fn path(self) -> &'static str {
        match self {
            List::Parked => "/parked",
            List::Dead => "/dead",
        }
    }
}

/// A list page's query: the filter, the page's cursor, and what the last action did.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ListQuery {
    pub(super) topic: Option<String>,
    #[serde(rename = "type")]
    pub(super) event_type: Option<String>,
    pub(super) since: Option<String>,
    pub(super) until: Option<String>,
    /// Parked: the last id of the previous page. Dead: the last row's `received_at`.
    pub(super) after: Option<String>,
    /// Dead: the last row's event id.
    pub(super) after_id: Option<String>,
    /// What the last action did (`retried:3`): shown once above the list.
    pub(super) done: Option<String>,
}

pub(super) fn given(value: &Option<String>) -> Option<&str> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// A time from a filter: RFC 3339, or a `datetime-local` field's value, taken as UTC.
pub(super) fn parse_time(field: &str, value: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(value) {
        return Ok(t.with_timezone(&Utc));
    }
    ["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d %H:%M:%S"]
        .iter()
        .find_map(|f| NaiveDateTime::parse_from_str(value, f).ok())
        .map(|t| t.and_utc())
        .ok_or_else(|| {
            format!(
                "`{field}`: `{value}` is not a time (write 2026-12-03T14:30, taken as UTC, or RFC 3339)"
            )
        })
}

impl ListQuery {
    /// The filter without a cursor or limit.
    pub(super) fn filter(&self) -> Result<PoisonFilter, String> {
        let mut filter = PoisonFilter::all();
        if let Some(topic) = given(&self.topic) {
            filter = filter.topic(topic);
        }
        if let Some(t) = given(&self.event_type) {
            filter = filter.event_type(t);
        }
        if let Some(since) = given(&self.since) {
            filter = filter.since(parse_time("since", since)?);
        }
        if let Some(until) = given(&self.until) {
            filter = filter.until(parse_time("until", until)?);
        }
        Ok(filter)
    }

    /// The filter's fields as a query string (without the cursor).
    pub(super) fn filter_query(&self) -> String {
        let mut q = form_urlencoded::Serializer::new(String::new());
        for (name, value) in [
            ("topic", &self.topic),
            ("type", &self.event_type),
            ("since", &self.since),
            ("until", &self.until),
        ] {
            if let Some(v) = given(value) {
                q.append_pair(name, v);
            }
        }
        q.finish()
    }
}

/// What an action does; the CLI's `outbox parked retry | drop` and `outbox inbox dead retry |
/// discard` call the same functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    RetryParked,
    SkipParked,
    RetryDead,
    DiscardDead,
}

impl Action {
    pub(super) fn list(self) -> List {
        match self {
            Action::RetryParked | Action::SkipParked => List::Parked,
            Action::RetryDead | Action::DiscardDead => List::Dead,
        }
    }

    /// The action's path, under the console's.
    pub(super) fn path(self) -> &'static str {
        match self {
            Action::RetryParked => "/parked/retry",
            Action::SkipParked => "/parked/skip",
            Action::RetryDead => "/dead/retry",
            Action::DiscardDead => "/dead/discard",
        }
    }

    /// The word for it in `done=` and the log.
    pub(super) fn verb(self) -> &'static str {
        match self {
            Action::RetryParked | Action::RetryDead => "retried",
            Action::SkipParked => "skipped",
            Action::DiscardDead => "discarded",
        }
    }

    /// The word for it on a button.
    pub(super) fn word(self) -> &'static str {
        match self {
            Action::RetryParked | Action::RetryDead => "retry",
            Action::SkipParked => "skip",
            Action::DiscardDead => "discard",
        }
    }

    /// The question the operator confirms, for `n` rows.
    pub(super) fn question(self, n: usize) -> String {
        let one = n == 1;
        let n = n as i64;
        match self {
            Action::RetryParked => format!(
                "Retry {}? The relay publishes {} again, after {} later events.",
                count(n, "parked event", "parked events"),
                if one { "it" } else { "them" },
                if one { "its key's" } else { "their keys'" },
            ),
            Action::SkipParked => format!(
                "Skip {}? {} deleted and will never be published.",
                count(n, "parked event", "parked events"),
                if one { "It is" } else { "They are" },
            ),
            Action::RetryDead => format!(
                "Retry {}? {} run again.",
                count(n, "dead inbox row", "dead inbox rows"),
                if one {
                    "Its handlers"
                } else {
                    "Their handlers"
                },
            ),
            Action::DiscardDead => format!(
                "Discard {}? {} never run; a redelivery is not handled either.",
                count(n, "dead inbox row", "dead inbox rows"),
                if one {
                    "Its handlers"
                } else {
                    "Their handlers"
                },
            ),
        }
    }
}
