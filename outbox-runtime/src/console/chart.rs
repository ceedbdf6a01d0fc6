//! The overview's charts: figures the console samples while it runs, drawn as SVG.

use std::collections::VecDeque;
use std::fmt::Write as _;

use chrono::{DateTime, Duration, Utc};
use maud::{html, Markup, PreEscaped};

use crate::admin::Status;

/// How far back the charts go.
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
    /// Adds the figures of `status`, read at `at`, and forgets samples older than the window.
    pub(super) fn push(&mut self, at: DateTime<Utc>, status: &Status) {
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
        // Requests read the figures too; a sample a second is plenty.
        if self
            .0
            .back()
            .is_some_and(|last| at - last.at < Duration::seconds(1))
        {
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

    pub(super) fn len(&self) -> usize {
        self.0.len()
    }
}

/// A series of a chart: its name, its colour (one of ours: it is written into the SVG as it
/// is) and its points.
pub(super) type Series<'a> = (&'a str, &'static str, Vec<(DateTime<Utc>, f64)>);

/// A line chart of one or more series over the last hour, ending now.
pub(super) fn line_chart(
    title: &str,
    unit: &str,
    now: DateTime<Utc>,
    series: &[Series<'_>],
) -> Markup {
    const W: f64 = 600.0;
    const H: f64 = 160.0;
    const LEFT: f64 = 56.0;
    const BOTTOM: f64 = 20.0;
    let max = series
        .iter()
        .flat_map(|(_, _, points)| points.iter().map(|p| p.1))
        .fold(0.0_f64, f64::max);
    let top = nice_ceiling(max);
    let start = now - WINDOW;
    let x = |at: DateTime<Utc>| {
        let f = (at - start).num_milliseconds() as f64 / WINDOW.num_milliseconds() as f64;
        LEFT + f.clamp(0.0, 1.0) * (W - LEFT - 4.0)
    };
    let y = |v: f64| 4.0 + (1.0 - v / top) * (H - BOTTOM - 8.0);
    let mut paths = String::new();
    for (_, color, points) in series {
        if points.is_empty() {
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
    html! {
        figure.chart {
            figcaption {
                (title) " "
                @for (name, color, points) in series {
                    span.key style={ "border-color:" (color) } {
                        (name) ": " (points.last().map_or_else(|| "-".to_owned(), |p| label(p.1))) " " (unit)
                    }
                }
            }
            svg viewBox={ "0 0 " (W) " " (H) } role="img" aria-label=(title) {
                line x1=(LEFT) y1=(y(top)) x2=(W - 4.0) y2=(y(top)) class="grid" {}
                line x1=(LEFT) y1=(y(top / 2.0)) x2=(W - 4.0) y2=(y(top / 2.0)) class="grid" {}
                line x1=(LEFT) y1=(y(0.0)) x2=(W - 4.0) y2=(y(0.0)) class="axis" {}
                text x=(LEFT - 6.0) y=(y(top) + 4.0) text-anchor="end" { (label(top)) }
                text x=(LEFT - 6.0) y=(y(top / 2.0) + 4.0) text-anchor="end" { (label(top / 2.0)) }
                text x=(LEFT - 6.0) y=(y(0.0) + 4.0) text-anchor="end" { "0" }
                text x=(LEFT) y=(H - 4.0) { "−60 min" }
                text x=(LEFT + (W - LEFT) / 2.0) y=(H - 4.0) text-anchor="middle" { "−30 min" }
                text x=(W - 4.0) y=(H - 4.0) text-anchor="end" { "now" }
                (PreEscaped(paths))
            }
        }
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
}
