//! Reading back what a test's `metrics` recorder (`metrics_util`'s debugging recorder) holds.

use metrics_util::debugging::{DebugValue, Snapshotter};

/// The value of the gauge `name` with the label `label`, if it was reported.
pub fn labelled_gauge(snapshotter: &Snapshotter, name: &str, label: (&str, &str)) -> Option<f64> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find(|(key, _, _, _)| {
            key.key().name() == name && key.key().labels().any(|l| (l.key(), l.value()) == label)
        })
        .and_then(|(_, _, _, value)| match value {
            DebugValue::Gauge(g) => Some(g.into_inner()),
            _ => None,
        })
}
