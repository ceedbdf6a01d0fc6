//! Parsing of the CLI's durations and times.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};

/// A duration like `30d`, `12h`, `90m`, `45s`, `500ms`, `2w`, or several of them (`1h30m`):
/// humantime's syntax (`30days`, `1h 30m`, `1.5h` too).
pub fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|e| {
        format!(
            "invalid duration `{text}`: {e}; expected a number and a unit (ms, s, m, h, d, w), \
             e.g. 30d or 1h30m"
        )
    })
}

/// A point in time: RFC 3339 (`2026-11-01T12:00:00Z`), a UTC date (`2026-11-01`) or date and
/// time (`2026-11-01 12:00:00`), or a duration meaning that long ago (`2h`).
pub fn time(text: &str) -> Result<DateTime<Utc>, String> {
    let text = text.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    for format in ["%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M"] {
        if let Ok(t) = NaiveDateTime::parse_from_str(text, format) {
            return Ok(t.and_utc());
        }
    }
    if let Ok(d) = NaiveDate::parse_from_str(text, "%Y-%m-%d") {
        return Ok(d.and_hms_opt(0, 0, 0).unwrap_or_default().and_utc());
    }
    match duration(text) {
        Ok(ago) => chrono::Duration::from_std(ago)
            .ok()
            .and_then(|ago| Utc::now().checked_sub_signed(ago))
            .ok_or_else(|| format!("invalid time `{text}`: too long ago")),
        Err(_) => Err(format!(
            "invalid time `{text}`: expected RFC 3339 (2026-11-01T12:00:00Z), a date \
             (2026-11-01, UTC) or a duration ago (2h)"
        )),
    }
}

/// `key=value`, for producer settings.
pub fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.trim().to_owned())),
        _ => Err(format!("invalid setting `{text}`: expected key=value")),
    }
}

/// A human-readable duration, rounded to its two largest units for a status line: `850ms`,
/// `12.3s`, `4m05s`, `3h12m`, `2d04h` (humantime's `format_duration` prints every unit down to
/// nanoseconds).
pub fn human(d: Duration) -> String {
    let secs = d.as_secs();
    if secs < 1 {
        format!("{}ms", d.as_millis())
    } else if secs < 60 {
        format!("{:.1}s", d.as_secs_f64())
    } else if secs < 3_600 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else if secs < 86_400 {
        format!("{}h{:02}m", secs / 3_600, secs % 3_600 / 60)
    } else {
        format!("{}d{:02}h", secs / 86_400, secs % 86_400 / 3_600)
    }
}

/// A table that can be partitioned: `processed`, `inbox` or `outbox` (or their table names).
pub fn partitioned_table(s: &str) -> Result<outbox_runtime::admin::CleanupTable, String> {
    s.parse::<outbox_runtime::admin::CleanupTable>()
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(duration("30d"), Ok(Duration::from_secs(30 * 86_400)));
        assert_eq!(duration("1h30m"), Ok(Duration::from_secs(5_400)));
        assert_eq!(duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(duration("2w"), Ok(Duration::from_secs(1_209_600)));
        assert_eq!(duration("0s"), Ok(Duration::ZERO));
        assert_eq!(duration("1.5h"), Ok(Duration::from_secs(5_400)));
        for bad in ["", "30", "d", "30x", "-1d", "99999999999999999999d"] {
            let err = duration(bad).unwrap_err();
            assert!(err.contains("invalid duration"), "{bad}: {err}");
        }
    }

    #[test]
    fn times() {
        let t = time("2026-11-01T12:00:00Z").unwrap();
        assert_eq!(t.to_rfc3339(), "2026-11-01T12:00:00+00:00");
        assert_eq!(time("2026-11-01T13:00:00+01:00").unwrap(), t);
        assert_eq!(time("2026-11-01 12:00:00").unwrap(), t);
        assert_eq!(
            time("2026-11-01").unwrap().to_rfc3339(),
            "2026-11-01T00:00:00+00:00"
        );
        let ago = Utc::now() - time("2h").unwrap();
        assert!((ago.num_seconds() - 7_200).abs() < 5, "{ago}");
        assert!(time("yesterday").unwrap_err().contains("invalid time"));
        assert!(time("2026-13-01").is_err());
    }

    #[test]
    fn settings_and_display() {
        assert_eq!(key_value("acks=all"), Ok(("acks".into(), "all".into())));
        assert!(key_value("acks").is_err());
        assert!(key_value("=x").is_err());
        assert_eq!(human(Duration::from_millis(850)), "850ms");
        assert_eq!(human(Duration::from_secs(245)), "4m05s");
        assert_eq!(human(Duration::from_secs(2 * 86_400 + 4 * 3_600)), "2d04h");
    }
}
