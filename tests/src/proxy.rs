//! A TCP proxy in front of PostgreSQL that counts the messages clients send, to assert how many
//! round trips and statements an operation takes.
//!
//! In the extended query protocol every round trip ends with a `Sync` message (`S`) and every
//! statement run is an `Execute` (`E`); a simple query (`Q`) is one round trip on its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Debug, Default)]
pub struct Counts {
    pub syncs: AtomicU64,
    pub executes: AtomicU64,
    pub simple_queries: AtomicU64,
}

impl Counts {
    /// Round trips so far: `Sync`s plus simple queries.
    pub fn round_trips(&self) -> u64 {
        self.syncs.load(Ordering::SeqCst) + self.simple_queries.load(Ordering::SeqCst)
    }
    /// Statements executed so far: `Execute`s plus simple queries.
    pub fn statements(&self) -> u64 {
        self.executes.load(Ordering::SeqCst) + self.simple_queries.load(Ordering::SeqCst)
    }
}

#[derive(Debug)]
pub struct Proxy {
    pub addr: std::net::SocketAddr,
    pub counts: Arc<Counts>,
}

impl Proxy {
    /// Starts a proxy to `upstream` (`host:port`) on a free local port.
    pub async fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let counts = Arc::new(Counts::default());
        let c = counts.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                tokio::spawn(relay(client, server, c.clone()));
            }
        });
        Proxy { addr, counts }
    }

    /// `url` pointed at this proxy, with TLS off so that the proxy can read the messages.
    pub fn url(&self, url: &str) -> String {
        let scheme_end = url.find("://").map_or(0, |i| i + 3);
        let rest = &url[scheme_end..];
        let host_start = rest.find('@').map_or(0, |i| i + 1);
        let host_end = rest[host_start..]
            .find(['/', '?'])
            .map_or(rest.len(), |i| host_start + i);
        let sep = if url.contains('?') { '&' } else { '?' };
        format!(
            "{}{}{}{}{sep}sslmode=disable",
            &url[..scheme_end],
            &rest[..host_start],
            self.addr,
            &rest[host_end..]
        )
    }
}

async fn relay(client: TcpStream, server: TcpStream, counts: Arc<Counts>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async move {
        // The startup message has no type byte; every later message does.
        let mut startup = true;
        loop {
            let kind = if startup {
                None
            } else {
                match client_read.read_u8().await {
                    Ok(kind) => Some(kind),
                    Err(_) => break,
                }
            };
            let Ok(len) = client_read.read_u32().await else {
                break;
            };
            let mut body = vec![0; (len as usize).saturating_sub(4)];
            if client_read.read_exact(&mut body).await.is_err() {
                break;
            }
            match kind {
                Some(b'S') => counts.syncs.fetch_add(1, Ordering::SeqCst),
                Some(b'E') => counts.executes.fetch_add(1, Ordering::SeqCst),
                Some(b'Q') => counts.simple_queries.fetch_add(1, Ordering::SeqCst),
                _ => 0,
            };
            let mut frame = Vec::with_capacity(body.len() + 5);
            frame.extend(kind);
            frame.extend_from_slice(&len.to_be_bytes());
            frame.extend_from_slice(&body);
            if server_write.write_all(&frame).await.is_err() {
                break;
            }
            startup = false;
        }
        let _ = server_write.shutdown().await;
    };
    let downstream = async move {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
    };
    tokio::join!(upstream, downstream);
}
