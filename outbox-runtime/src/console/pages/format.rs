//! How the pages write figures, times, long texts and payloads.

use chrono::{DateTime, Utc};
use maud::{html, Markup};

use crate::admin::PayloadSummary;

/// `2026-12-03 11:42:07 UTC`.
pub(super) fn time(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// `2026-12-03 11:42`: a time in a list (the whole in its title).
pub(super) fn minute(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M").to_string()
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

/// `10 s`, `1 min 30 s`, `1 h`: a setting's interval.
pub(super) fn interval(d: std::time::Duration) -> String {
    let s = d.as_secs();
    let parts = [(s / 3600, "h"), (s % 3600 / 60, "min"), (s % 60, "s")];
    let words: Vec<String> = parts
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, unit)| format!("{n} {unit}"))
        .collect();
    if words.is_empty() {
        format!("{} ms", d.as_millis())
    } else {
        words.join(" ")
    }
}

/// `17:07:03`: a time of today, to the second (UTC).
pub(super) fn clock(at: DateTime<Utc>) -> String {
    at.format("%H:%M:%S").to_string()
}

/// `1 row`, `12,345 rows`: a figure and its noun, agreeing.
pub(in crate::console) fn count(v: i64, one: &str, many: &str) -> String {
    format!("{} {}", n(v), if v == 1 { one } else { many })
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

/// A size in bytes, as an operator reads it: `345 B`, `12.3 kB`, `1.15 MB` (powers of ten,
/// three significant figures).
pub(super) fn size(bytes: i64) -> String {
    let b = bytes.max(0) as f64;
    let (value, unit) = match bytes {
        ..=999 => return format!("{} B", bytes.max(0)),
        1_000..=999_999 => (b / 1e3, "kB"),
        1_000_000..=999_999_999 => (b / 1e6, "MB"),
        _ => (b / 1e9, "GB"),
    };
    let decimals = if value < 10.0 {
        2
    } else if value < 100.0 {
        1
    } else {
        0
    };
    format!("{value:.decimals$} {unit}")
}

/// A payload in a list: its size, and the start of a small one (a large one is not read: its
/// size is what PostgreSQL stores, and its exact size is on its event page).
pub(super) fn payload_summary(p: &PayloadSummary) -> Markup {
    let (shown, title) = match p.json_bytes {
        Some(bytes) => (size(bytes), format!("{} bytes as JSON", n(bytes))),
        None if p.compressed => (
            format!("{} compressed", size(p.stored_bytes)),
            "stored compressed: larger as JSON; its exact size is on its event page".to_owned(),
        ),
        None => (
            format!("≈{}", size(p.stored_bytes)),
            "about (what PostgreSQL stores); its exact size is on its event page".to_owned(),
        ),
    };
    html! {
        span.size title=(title) { (shown) }
        @if let Some(preview) = &p.preview {
            " " code.preview title=(preview) { (preview) }
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
        assert_eq!(count(1, "row", "rows"), "1 row");
        assert_eq!(count(0, "row", "rows"), "0 rows");
        assert_eq!(count(12_345, "row", "rows"), "12,345 rows");
        assert_eq!(interval(std::time::Duration::from_secs(3600)), "1 h");
        assert_eq!(interval(std::time::Duration::from_secs(90)), "1 min 30 s");
        assert_eq!(size(0), "0 B");
        assert_eq!(size(999), "999 B");
        assert_eq!(size(12_345), "12.3 kB");
        assert_eq!(size(1_152_021), "1.15 MB");
        assert_eq!(size(57_538_461), "57.5 MB");
        assert_eq!(size(2_000_000_000), "2.00 GB");
    }
}
