//! How the pages write figures, times, long texts and payloads.

use chrono::{DateTime, Utc};
use maud::{html, Markup};

/// `2026-12-03 11:42:07 UTC`.
pub(super) fn time(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

pub(super) fn time_opt(at: Option<DateTime<Utc>>) -> String {
    at.map_or_else(|| "-".to_owned(), time)
}

/// `3 h 4 min`, `4 min 3 s`, `12 s`.
pub(super) fn age(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{} min {} s", s / 60, s % 60),
        3600..=86_399 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86_400, s % 86_400 / 3600),
    }
}

/// `12,345`.
pub(super) fn n(v: i64) -> String {
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
pub(super) fn long_text(text: &str, shown: usize) -> Markup {
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
pub(super) fn payload(value: &serde_json::Value) -> Markup {
    let compact = value.to_string();
    let pretty = serde_json::to_string_pretty(value).unwrap_or_else(|_| compact.clone());
    html! {
        details.payload {
            summary { (compact.chars().take(80).collect::<String>()) @if compact.chars().count() > 80 { "…" } }
            pre { (pretty) }
        }
    }
}

pub(super) fn urlencode(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
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
    }
}
