//! The overview's charts: figures the console samples while it runs, drawn as SVG. The time
//! axis starts at the first sample until the console has sampled for an hour, then spans the
//! last hour; a chart with nothing to draw says why.

use std::collections::VecDeque;
use std::fmt::Write as _;

use chrono::{DateTime, Duration, Utc};
use maud::{html, Markup, PreEscaped};

use crate::admin::Status;

/// How far back the charts go, at most.
const WINDOW: Duration = Duration::hours(1);

/// One sample of the figures the charts draw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Sample {
    pub(super) at: DateTime<Utc>,
    /// Unpublished outbox rows (parked ones excluded).
    pub(super) outbox_backlog: f64,
    /// Unprocessed inbox rows (dead ones excluded).
    pub(super) inbox_backlog: f64,
    /// Events published a second, over the minute before the sample.
    pub(super) publish_rate: f64,
}

/// The last hour's samples, oldest first.
#[derive(Debug, Default)]
pub(super) struct Samples(VecDeque<Sample>);

impl Samples {
    /// Adds the figures of `status`, read at `at`, unless the last sample is less than
    /// `min_gap` old, and forgets samples older than the window.
    pub(super) fn push(&mut self, at: DateTime<Utc>, status: &Status, min_gap: Duration) {
        let sample = Sample {
            at,
            outbox_backlog: status.outbox.iter().map(|t| t.unpublished).sum::<i64>() as f64,
            inbox_backlog: status.inbox.iter().map(|t| t.unprocessed).sum::<i64>() as f64,
            publish_rate: status
                .outbox
                .iter()
                .map(|t| t.published_last_minute)
                .sum::<i64>() as f64
                / 60.0,
        };
        // Requests read the figures too (when theirs are stale, or after an action): the
        // charts keep about a sample an interval.
        if self.0.back().is_some_and(|last| at - last.at < min_gap) {
            return;
        }
        self.0.push_back(sample);
        while self.0.front().is_some_and(|s| at - s.at > WINDOW) {
            self.0.pop_front();
        }
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Sample> {
        self.0.iter()
    }

    pub(super) fn first(&self) -> Option<&Sample> {
        self.0.front()
    }

    pub(super) fn len(&self) -> usize {
        self.0.len()
    }
}

/// A series of a chart: its name, its colour (one of ours: it is written into the SVG as it
/// is) and its points.
pub(super) type Series<'a> = (&'a str, &'static str, Vec<(DateTime<Utc>, f64)>);

/// A chart of the overview.
pub(super) struct Chart<'a> {
    pub(super) title: &'a str,
    /// Its class (`backlog`, `publish-rate`).
    pub(super) class: &'static str,
    pub(super) unit: &'a str,
    pub(super) series: Vec<Series<'a>>,
    /// Why it has nothing to draw, when it has not (no sample, one, or nothing but zeros).
    pub(super) empty: Option<String>,
}

/// Where a chart's time axis starts: its first sample until it has an hour of them, then an
/// hour back.
pub(super) fn axis_start(now: DateTime<Utc>, samples: &Samples) -> DateTime<Utc> {
    samples.first().map_or(now, |s| s.at).max(now - WINDOW)
}

/// Whether the axis spans the whole window (the console has sampled for an hour).
pub(super) fn full_window(now: DateTime<Utc>, start: DateTime<Utc>) -> bool {
    now - start >= WINDOW - Duration::seconds(1)
}

/// `-12 s`, `-4 min 3 s`, `-60 min`: an offset before now, for the axis.
fn before_now(secs: i64) -> String {
    match secs {
        0 => "now".to_owned(),
        1..=59 => format!("−{secs} s"),
        _ if secs % 60 == 0 => format!("−{} min", secs / 60),
        _ => format!("−{} min {} s", secs / 60, secs % 60),
    }
}

/// A line chart of one or more series, from `start` (see [`axis_start`]) to now.
pub(super) fn line_chart(chart: &Chart<'_>, start: DateTime<Utc>, now: DateTime<Utc>) -> Markup {
    const W: f64 = 600.0;
    const H: f64 = 160.0;
    const LEFT: f64 = 56.0;
    const BOTTOM: f64 = 20.0;
    let max = chart
        .series
        .iter()
        .flat_map(|(_, _, points)| points.iter().map(|p| p.1))
        .fold(0.0_f64, f64::max);
    let top = nice_ceiling(max);
    let span_ms = (now - start).num_milliseconds().max(1) as f64;
    let x = |at: DateTime<Utc>| {
        let f = (at - start).num_milliseconds() as f64 / span_ms;
        LEFT + f.clamp(0.0, 1.0) * (W - LEFT - 4.0)
    };
    let y = |v: f64| 4.0 + (1.0 - v / top) * (H - BOTTOM - 8.0);
    let mut paths = String::new();
    for (_, color, points) in &chart.series {
        // A line needs two points.
        if points.len() < 2 {
            continue;
        }
        let mut d = String::new();
        for (i, (at, v)) in points.iter().enumerate() {
            let _ = write!(
                d,
                "{}{:.1},{:.1}",
                if i == 0 { "M" } else { " L" },
                x(*at),
                y(*v)
            );
        }
        let _ = write!(
            paths,
            r#"<path d="{d}" fill="none" stroke="{color}" stroke-width="2"/>"#
        );
    }
    let label = |v: f64| {
        if top >= 10.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    };
    let span = (now - start).num_seconds();
    html! {
        figure class={ "chart " (chart.class) } {
            figcaption {
                (chart.title) " "
                @for (name, color, points) in &chart.series {
                    span.key style={ "border-color:" (color) } {
                        (name) ": " (points.last().map_or_else(|| "-".to_owned(), |p| figure(p.1))) " " (chart.unit)
                    }
                }
            }
            @if let Some(empty) = &chart.empty {
                p.empty { (empty) }
            }
            svg viewBox={ "0 0 " (W) " " (H) } role="img" aria-label=(chart.title) {
                line x1=(LEFT) y1=(y(top)) x2=(W - 4.0) y2=(y(top)) class="grid" {}
                line x1=(LEFT) y1=(y(top / 2.0)) x2=(W - 4.0) y2=(y(top / 2.0)) class="grid" {}
                line x1=(LEFT) y1=(y(0.0)) x2=(W - 4.0) y2=(y(0.0)) class="axis" {}
                text x=(LEFT - 6.0) y=(y(top) + 4.0) text-anchor="end" { (label(top)) }
                text x=(LEFT - 6.0) y=(y(top / 2.0) + 4.0) text-anchor="end" { (label(top / 2.0)) }
                text x=(LEFT - 6.0) y=(y(0.0) + 4.0) text-anchor="end" { "0" }
                @if span > 0 {
                    text x=(LEFT) y=(H - 4.0) { (before_now(span)) }
                }
                @if span > 1 {
                    text x=(LEFT + (W - LEFT) / 2.0) y=(H - 4.0) text-anchor="middle" { (before_now(span / 2)) }
                }
                text x=(W - 4.0) y=(H - 4.0) text-anchor="end" { "now" }
                (PreEscaped(paths))
            }
        }
    }
}

/// A sample's figure: a count as an integer, a rate to a tenth.
fn figure(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// 1, 2 or 5 times a power of ten, at or above `v` (at least 1).
fn nice_ceiling(v: f64) -> f64 {
    if v <= 1.0 {
        return 1.0;
    }
    let magnitude = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * magnitude)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_ends_on_a_round_figure() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(1.5), 2.0);
        assert_eq!(nice_ceiling(7.0), 10.0);
        assert_eq!(nice_ceiling(10.0), 10.0);
        assert_eq!(nice_ceiling(4200.0), 5000.0);
    }

    #[test]
    fn the_axis_says_how_far_back_it_starts() {
        assert_eq!(before_now(12), "−12 s");
        assert_eq!(before_now(243), "−4 min 3 s");
        assert_eq!(before_now(3600), "−60 min");
    }
}
