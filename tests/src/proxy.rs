//! A TCP proxy in front of PostgreSQL that counts the messages clients send, to assert how many
//! round trips and statements an operation takes, and that can fail the network on demand: cut
//! a connection right after a statement went through, or black-hole all traffic without closing
//! anything (a host that vanished).
//!
//! In the extended query protocol every round trip ends with a `Sync` message (`S`) and every
//! statement run is an `Execute` (`E`); a simple query (`Q`) is one round trip on its own.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
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

/// What the proxy does with traffic.
const FORWARD: u8 = 0;
/// Forward a simple query that contains `COMMIT`, then close that connection before the
/// server's answer can reach the client. Back to `FORWARD` afterwards.
const CUT_AFTER_COMMIT: u8 = 1;
/// Read and drop everything in both directions; close nothing. New connections are accepted
/// and black-holed too.
const BLACK_HOLE: u8 = 2;

#[derive(Debug)]
pub struct Proxy {
    pub addr: std::net::SocketAddr,
    pub counts: Arc<Counts>,
    mode: Arc<AtomicU8>,
}

impl Proxy {
    /// Starts a proxy to `upstream` (`host:port`) on a free local port.
    pub async fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let counts = Arc::new(Counts::default());
        let mode = Arc::new(AtomicU8::new(FORWARD));
        let (c, m) = (counts.clone(), mode.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if m.load(Ordering::SeqCst) == BLACK_HOLE {
                    tokio::spawn(swallow(client));
                    continue;
                }
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                tokio::spawn(relay(client, server, c.clone(), m.clone()));
            }
        });
        Proxy { addr, counts, mode }
    }

    /// The next simple query containing `COMMIT` reaches the server, and then its connection
    /// is closed before the answer comes back: the client cannot know whether it committed.
    pub fn cut_after_next_commit(&self) {
        self.mode.store(CUT_AFTER_COMMIT, Ordering::SeqCst);
    }

    /// From now on nothing passes in either direction and no socket is closed, as when the
    /// client's host vanishes from the network.
    pub fn black_hole(&self) {
        self.mode.store(BLACK_HOLE, Ordering::SeqCst);
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

    /// A pool of at most `max_connections` to the database at `url`, through this proxy.
    pub async fn pool(&self, url: &str, max_connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .connect(&self.url(url))
            .await
            .expect("connect through the proxy")
    }
}

/// Reads and drops what `socket` sends, holding it open until the peer closes it.
async fn swallow(mut socket: impl AsyncReadExt + Unpin) {
    let mut buf = [0u8; 8192];
    while matches!(socket.read(&mut buf).await, Ok(n) if n > 0) {}
    // Keep the socket open after EOF too: a vanished host never answers.
    std::future::pending::<()>().await;
}

async fn relay(client: TcpStream, server: TcpStream, counts: Arc<Counts>, mode: Arc<AtomicU8>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let cut = Arc::new(tokio::sync::Notify::new());
    let (cut_up, cut_down) = (cut.clone(), cut.clone());
    let up_mode = mode.clone();
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
            if up_mode.load(Ordering::SeqCst) == BLACK_HOLE {
                // Keep both sockets (the server's write half lives in this future) open.
                swallow(client_read).await;
                return;
            }
            let mut frame = Vec::with_capacity(body.len() + 5);
            frame.extend(kind);
            frame.extend_from_slice(&len.to_be_bytes());
            frame.extend_from_slice(&body);
            if server_write.write_all(&frame).await.is_err() {
                break;
            }
            let is_commit = kind == Some(b'Q') && String::from_utf8_lossy(&body).contains("COMMIT");
            if is_commit
                && up_mode
                    .compare_exchange(
                        CUT_AFTER_COMMIT,
                        FORWARD,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    )
                    .is_ok()
            {
                // The server has the statement; the client never learns what became of it.
                cut_up.notify_one();
                return;
            }
            startup = false;
        }
        let _ = server_write.shutdown().await;
    };
    let downstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = tokio::select! {
                biased;
                () = cut_down.notified() => return,
                read = server_read.read(&mut buf) => match read {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                },
            };
            if mode.load(Ordering::SeqCst) == BLACK_HOLE {
                swallow(server_read).await;
                return;
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = client_write.shutdown().await;
    };
    tokio::join!(upstream, downstream);
}
