//! The relay's and consumers' metrics on an HTTP endpoint, for Prometheus to scrape, beside the
//! liveness and readiness probes orchestrators ask for.

use std::net::SocketAddr;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::error::{Error, Result};
use crate::relay::Relay;

/// Serves every metric recorded through the `metrics` facade (the relay's, the consumers', and
/// the application's own) at `http://addr/metrics` in Prometheus' text format, and `/health`
/// (liveness: `200 ok` while the process serves requests) and `/ready` (`200`: nothing to
/// check; [`serve_prometheus_for_relay`] checks a relay), from tasks on the current tokio
/// runtime.
///
/// It installs the process's global `metrics` recorder: call it once, early in `main`, inside
/// the runtime, before anything else installs one. Fails if `addr` cannot be bound or a
/// recorder was installed already.
///
/// ```no_run
/// # async fn app() -> outbox_runtime::Result<()> {
/// outbox_runtime::serve_prometheus(([0, 0, 0, 0], 9464).into())?;
/// # Ok(()) }
/// ```
pub fn serve_prometheus(addr: SocketAddr) -> Result<()> {
    serve(addr, None)
}

/// [`serve_prometheus`], with `/ready` answering for `relay`
/// ([`Relay::ready`](crate::relay::Relay::ready)): `200` with what it checked when the database
/// and the broker answer and one of its instances owns shards, `503` with the reason
/// otherwise. `outbox relay --metrics-addr` uses it.
pub fn serve_prometheus_for_relay(addr: SocketAddr, relay: &Relay) -> Result<()> {
    serve(addr, Some(relay.clone()))
}

fn serve(addr: SocketAddr, relay: Option<Relay>) -> Result<()> {
    let failed = |source: Box<dyn std::error::Error + Send + Sync>| Error::Metrics { addr, source };
    let listener = std::net::TcpListener::bind(addr).map_err(|e| failed(e.into()))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| failed(e.into()))?;
    let listener = TcpListener::from_std(listener).map_err(|e| failed(e.into()))?;
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| failed(e.into()))?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(accept(listener, handle, relay));
    Ok(())
}

/// Connections answered at once; more wait to be accepted.
const CONCURRENT: usize = 32;

async fn accept(listener: TcpListener, handle: PrometheusHandle, relay: Option<Relay>) {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(CONCURRENT));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        match listener.accept().await {
            Ok((stream, _)) => {
                let (handle, relay) = (handle.clone(), relay.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    // A client that sends nothing, or reads nothing, costs a task for this long.
                    let _ = tokio::time::timeout(
                        Duration::from_secs(10),
                        respond(stream, &handle, relay.as_ref()),
                    )
                    .await;
                });
            }
            Err(e) => {
                tracing::debug!(error = %e, "metrics endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Reads one request's head and answers it; the connection closes after each response.
async fn respond(
    mut stream: TcpStream,
    handle: &PrometheusHandle,
    relay: Option<&Relay>,
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 || head.len() > 16 * 1024 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or(&[]);
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET" | "HEAD", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            handle.render(),
        ),
        ("GET" | "HEAD", "/health") => ("200 OK", "text/plain; charset=utf-8", "ok\n".into()),
        ("GET" | "HEAD", "/ready") => match relay {
            None => ("200 OK", "text/plain; charset=utf-8", "ready\n".into()),
            Some(relay) => match relay.ready().await {
                Ok(what) => (
                    "200 OK",
                    "text/plain; charset=utf-8",
                    format!("ready: {what}\n"),
                ),
                Err(why) => (
                    "503 Service Unavailable",
                    "text/plain; charset=utf-8",
                    format!("not ready: {why}\n"),
                ),
            },
        },
        ("GET" | "HEAD", _) => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found: /metrics, /health and /ready are served here\n".into(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "only GET and HEAD\n".into(),
        ),
    };
    let mut response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if method != "HEAD" {
        response.extend_from_slice(body.as_bytes());
    }
    stream.write_all(&response).await?;
    stream.shutdown().await
}
