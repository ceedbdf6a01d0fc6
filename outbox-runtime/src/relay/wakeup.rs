//! Wake-ups: `outbox_emit`'s NOTIFY, read by a task of its own as it arrives.
//!
//! PostgreSQL writes notifications to a listening session whenever that session is idle, under
//! a snapshot it keeps until they are written to the socket. A client that does not read (a
//! relay busy with its batches, or waiting for its broker) lets the socket fill: the session
//! then blocks with that snapshot held, which holds back the cleanup horizon of the whole
//! server (vacuum removes nothing deleted since, in any table), and its place in the NOTIFY
//! queue keeps the queue from being truncated (once full, every notifying commit, and so every
//! emit, fails). So the listener is drained all the time, whatever the relay does, and what it
//! reads becomes one coalescing signal: a counter the relay compares with what it saw when its
//! last claim began.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::Backoff;

/// The channel `outbox_emit` notifies.
const CHANNEL: &str = "outbox_event";

/// The name the listener's session shows in `pg_stat_activity`.
const APPLICATION_NAME: &str = "outbox-relay-listener";

/// A relay instance's wake-ups: the listening task, stopped when this is dropped.
pub(super) struct Wakeups {
    options: PgConnectOptions,
    limit: Duration,
    backoff: Backoff,
    signal: Arc<watch::Sender<u64>>,
    seen: watch::Receiver<u64>,
    task: JoinHandle<()>,
}

impl Drop for Wakeups {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Wakeups {
    /// Starts listening, on a connection of its own with `pool`'s settings (outside the pool,
    /// so it takes none of the application's connections). A lost connection is made again
    /// after `backoff`; an attempt to connect gives up after `limit`.
    pub(super) fn start(pool: &PgPool, limit: Duration, backoff: Backoff) -> Wakeups {
        let (signal, seen) = watch::channel(0);
        let options = pool
            .connect_options()
            .as_ref()
            .clone()
            .application_name(APPLICATION_NAME);
        let signal = Arc::new(signal);
        let task = spawn(&options, limit, &signal, backoff);
        Wakeups {
            options,
            limit,
            backoff,
            signal,
            seen,
            task,
        }
    }

    /// Abandons the connection and listens on a new one: the relay lost its own connection,
    /// and this one, to the same server, may be as dead without knowing it yet.
    pub(super) fn reconnect(&mut self) {
        self.task.abort();
        self.task = spawn(&self.options, self.limit, &self.signal, self.backoff);
    }

    /// Takes note of every notification so far: the caller is about to look at the outbox, and
    /// will see what they announced.
    pub(super) fn mark_seen(&mut self) {
        self.seen.borrow_and_update();
    }

    /// Waits for a notification that arrived since [`mark_seen`](Self::mark_seen) (at once if
    /// one did).
    pub(super) async fn notified(&mut self) {
        // The sender lives as long as `self`.
        let _ = self.seen.changed().await;
    }
}

/// The listening task, on a pool of one connection of its own: an abandoned connection (its
/// server gone silent) never stands in the way of the next.
fn spawn(
    options: &PgConnectOptions,
    limit: Duration,
    signal: &Arc<watch::Sender<u64>>,
    backoff: Backoff,
) -> JoinHandle<()> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(limit)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(options.clone());
    tokio::spawn(drain(pool, Arc::clone(signal), backoff))
}

/// Reads every notification as it arrives and bumps the counter once for each read that found
/// some, for ever. A lost connection is connected again; what was notified meanwhile is lost,
/// so reconnecting bumps the counter too.
async fn drain(pool: PgPool, signal: Arc<watch::Sender<u64>>, backoff: Backoff) {
    let wake = || signal.send_modify(|n| *n = n.wrapping_add(1));
    let mut failures = 0u32;
    loop {
        match listen(&pool).await {
            Ok(mut listener) => {
                failures = 0;
                wake();
                loop {
                    match listener.try_recv().await {
                        Ok(Some(_)) => {
                            while listener.next_buffered().is_some() {}
                            wake();
                        }
                        // The connection was lost (and made again, listening again).
                        Ok(None) => wake(),
                        Err(e) => {
                            tracing::debug!(error = %crate::error_chain(&e),
                                "outbox relay's listener failed; connecting again");
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::debug!(error = %crate::error_chain(&e),
                    "outbox relay cannot listen for notifications; polling meanwhile");
            }
        }
        failures = failures.saturating_add(1);
        tokio::time::sleep(backoff.jittered(failures)).await;
    }
}

async fn listen(pool: &PgPool) -> sqlx::Result<PgListener> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(CHANNEL).await?;
    Ok(listener)
}
