//! `--demo N`: a client of the orders API, over real HTTP, then a wait until every order it
//! placed is paid, and the latency from each order's commit to its handlers ([`super::latency`]).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::http::{header, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use uuid::Uuid;

use super::db::OrdersDb;
use super::Result;

/// How long `--demo` waits for every order to be paid.
const DEMO_TIMEOUT: Duration = Duration::from_secs(60);
/// Keep-alive connections `--demo` posts its orders over, concurrently.
const DEMO_CONNECTIONS: usize = 4;

/// Posts `n` orders to the API at `addr`, then waits until all are paid.
pub async fn run(addr: SocketAddr, orders_db: OrdersDb, n: usize) -> Result<()> {
    let started = Instant::now();
    let connections = DEMO_CONNECTIONS.min(n);
    let mut clients = Vec::with_capacity(connections);
    for c in 0..connections {
        // Connection `c` posts orders c, c + connections, c + 2 * connections, ...
        let orders: Vec<usize> = (c..n).step_by(connections).collect();
        clients.push(tokio::spawn(post_orders(addr, orders)));
    }
    let mut ids = Vec::with_capacity(n);
    for client in clients {
        ids.extend(client.await??);
    }
    println!(
        "demo: posted {n} orders over {connections} connections in {:.2} s; waiting for payments",
        started.elapsed().as_secs_f64()
    );

    let deadline = started + DEMO_TIMEOUT;
    loop {
        let paid = orders_db.paid(&ids).await?;
        let elapsed = started.elapsed().as_secs_f64();
        if paid as usize == n {
            println!("demo: {paid}/{n} orders paid in {elapsed:.2} s");
            let orders_mode = match orders_db {
                OrdersDb::Postgres(_) => "inbox",
                OrdersDb::MariaDb(_) => "dedup",
            };
            for line in super::latency::report(&ids, orders_mode) {
                println!("{line}");
            }
            return Ok(());
        }
        if Instant::now() >= deadline {
            println!("demo: {paid}/{n} orders paid in {elapsed:.2} s (timed out)");
            return Err(
                format!("only {paid} of {n} orders were paid within {DEMO_TIMEOUT:?}").into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Posts one order per entry of `orders` on one keep-alive connection; returns their ids.
async fn post_orders(addr: SocketAddr, orders: Vec<usize>) -> Result<Vec<Uuid>> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    // Drives the connection; it ends when `sender` is dropped.
    tokio::spawn(connection);

    #[derive(Deserialize)]
    struct Created {
        order_id: Uuid,
    }
    let mut ids = Vec::with_capacity(orders.len());
    for i in orders {
        let body = serde_json::json!({
            "customer_id": format!("customer-{}", i % 10),
            "product_id": format!("product-{}", i % 7),
            "amount": 100 + i,
        });
        let request = hyper::Request::post("/orders")
            .header(header::HOST, addr.to_string())
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))?;
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        if status != StatusCode::CREATED {
            let body = String::from_utf8_lossy(&body);
            return Err(format!("POST /orders answered {status}: {body}").into());
        }
        ids.push(serde_json::from_slice::<Created>(&body)?.order_id);
    }
    Ok(ids)
}
