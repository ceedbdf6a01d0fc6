//! The orders API's HTTP plumbing: error answers as JSON, the server and the address a client
//! reaches it at, and the `curl` commands to try.

use std::error::Error;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::Result;

/// An error answer: a status and `{"error": "..."}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    /// `status` with `{"error": message}`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }

    /// The details (the error and its causes) go to the log, not to the client.
    fn internal(error: impl Error + 'static) -> Self {
        eprintln!("internal error: {}", outbox_runtime::error_chain(&error));
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal error; see the server's log",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(serde_json::json!({ "error": self.message }));
        (self.status, body).into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        ApiError::new(rejection.status(), rejection.body_text())
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        ApiError::internal(error)
    }
}

impl From<outbox_runtime::Error> for ApiError {
    fn from(error: outbox_runtime::Error) -> Self {
        ApiError::internal(error)
    }
}

/// The HTTP server: serves its routes until `shutdown` fires, then lets the requests in flight
/// finish.
pub struct Server {
    addr: SocketAddr,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// Listens on `listen` and serves `app` until `shutdown`.
    pub async fn start(
        listen: SocketAddr,
        app: Router,
        shutdown: &CancellationToken,
    ) -> Result<Server> {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        let addr = reachable(listener.local_addr()?);
        let stopped = shutdown.clone().cancelled_owned();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(stopped)
                .await
        });
        Ok(Server { addr, task })
    }

    /// Where a client reaches it.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits for the server to finish (after `shutdown` fired).
    pub async fn stop(self) -> Result<(), String> {
        match self.task.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("HTTP server: {e}")),
            Err(e) => Err(format!("HTTP server: {e}")),
        }
    }
}

/// A listening address as a client can reach it: 0.0.0.0 and [::] become the loopback.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
}

/// Prints the `curl` commands to try the API at `addr`.
pub fn print_try_it(addr: SocketAddr) {
    let post = format!("curl -si http://{addr}/orders -H 'content-type: application/json' -d");
    let order = r#"{"customer_id": "c-1", "product_id": "book-42", "amount": 1500}"#;
    println!();
    println!("try:");
    println!("  {post} '{order}'");
    println!("  curl -s http://{addr}/orders/ORDER_ID   # payment_status: pending, then paid");
    println!("  {post} '{}'   # 422", order.replace("1500", "0"));
    println!();
    println!("Ctrl-C stops it.");
}
