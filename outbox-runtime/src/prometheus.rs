//! The relay's and consumers' metrics on an HTTP endpoint, for Prometheus to scrape.

use std::net::SocketAddr;

use crate::error::{Error, Result};

/// Serves every metric recorded through the `metrics` facade (the relay's, the consumers', and
/// the application's own) at `http://addr/metrics` in Prometheus' text format, from a task on
/// the current tokio runtime; `outbox relay --metrics-addr` uses it.
///
/// It installs the process's global `metrics` recorder: call it once, early in `main`, inside
/// the runtime, before anything else installs one. Fails if `addr` cannot be bound; fails too
/// if a recorder was installed already, but the endpoint has started by then (serving nothing
/// this crate records).
///
/// ```no_run
/// # async fn app() -> outbox_runtime::Result<()> {
/// outbox_runtime::serve_prometheus(([0, 0, 0, 0], 9464).into())?;
/// # Ok(()) }
/// ```
pub fn serve_prometheus(addr: SocketAddr) -> Result<()> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|source| Error::Metrics { addr, source })
}
