//! The relay on MariaDB and MySQL (feature `mysql`): an instance's loop and batch over
//! `mysql/relay.rs`'s SQL. What differs from PostgreSQL's (`run.rs`, `instance.rs`): no
//! cursor (every claim starts at the first unpublished row of the owned shards, so a lower id
//! that commits after a higher one is not skipped), shards owned through `GET_LOCK`, and no
//! `LISTEN`: a unit of work committed in this process wakes the relay at once
//! (`mysql/wake.rs`); otherwise it polls, 5 ms after the last rows it found, doubling up to
//! the poll interval while it finds none.

use std::collections::BTreeSet;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use sqlx::MySqlPool;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::gauges::{report_backlog, Owning, GAUGES_EVERY};
use super::instance::{Step, REBALANCE_EVERY};
use super::settings::Settings;
use super::RelayStatus;
use crate::error::{Error, Result};
use crate::mysql::relay::{self as store, Session};
use crate::publish::{Outcome, Transport};

/// The first wait after a claim that found nothing, doubled each time up to the poll interval.
const FIRST_POLL: Duration = Duration::from_millis(5);

/// How an error names the database.
const DATABASE: &str = "MariaDB/MySQL";

/// What an instance is run with, of its relay's.
pub(super) struct Parts<'a> {
    pub(super) settings: &'a Settings,
    pub(super) transport: Option<&'a dyn Transport>,
    /// Instances owning shards now.
    pub(super) owning: &'a AtomicUsize,
    /// Starts the relay's health check and retention if they are due (each on a task of its
    /// own).
    pub(super) periodic: &'a (dyn Fn() + Sync),
}

/// Runs one instance until `cancel` fires; see [`super::Relay::run`].
pub(super) async fn run(
    parts: Parts<'_>,
    pool: &MySqlPool,
    cancel: CancellationToken,
) -> Result<()> {
    let Parts {
        settings,
        transport,
        owning,
        periodic,
    } = parts;
    let mut instance = Instance::new(pool, settings, transport);
    let mut commits = crate::mysql::wake::subscribe();
    let mut failures = 0u32;
    let mut idle = FIRST_POLL;
    let mut gauges_at: Option<Instant> = None;
    let mut owning = Owning {
        count: owning,
        owns: false,
    };
    let aside = settings.poll_interval.max(Duration::from_secs(1));
    while !cancel.is_cancelled() {
        if gauges_at.is_none_or(|t| t.elapsed() >= GAUGES_EVERY) {
            // On a task of its own: the session waits idle meanwhile, and must not outlive
            // its `wait_timeout` because the backlog's count is slow.
            gauges_at = Some(Instant::now());
            let pool = pool.clone();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(aside, report(&pool)).await;
            });
        }
        periodic();
        // Commits from here on may be of rows this step's claim does not see.
        commits.borrow_and_update();
        let step = instance.step().await;
        owning.set(instance.owns_shards());
        match step {
            Ok(Step::Full | Step::Partial) => {
                failures = 0;
                idle = FIRST_POLL;
            }
            Ok(Step::Empty) => {
                failures = 0;
                // Without shards, look again soon: another instance is about to free some.
                // With them, soon enough that the server does not end the idle session.
                let wait = if instance.owns_shards() {
                    idle.min(settings.poll_interval)
                        .min(settings.failover_timeout / 2)
                } else {
                    settings.poll_interval.min(REBALANCE_EVERY)
                };
                idle = (idle * 2).min(settings.poll_interval);
                // An instance without shards has nothing to publish whatever commits.
                let owns = instance.owns_shards();
                tokio::select! {
                    () = cancel.cancelled() => {}
                    () = tokio::time::sleep(wait) => {}
                    _ = commits.changed(), if owns => {}
                }
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                let backoff = settings.backoff.jittered(failures);
                tracing::warn!(error = %crate::error_chain(&e), ?backoff, "outbox relay batch failed; retrying");
                metrics::counter!("outbox_relay_batch_failures_total").increment(1);
                instance.reset();
                owning.set(false);
                tokio::select! {
                    () = cancel.cancelled() => {}
                    () = tokio::time::sleep(backoff) => {}
                }
            }
        }
    }
    instance.close().await;
    Ok(())
}

/// See [`super::Relay::publish_pending`].
pub(super) async fn publish_pending(
    settings: &Settings,
    transport: Option<&dyn Transport>,
    pool: &MySqlPool,
) -> Result<u64> {
    let mut instance = Instance::new(pool, settings, transport);
    let result = instance.drain().await;
    instance.close().await;
    result
}

async fn report(pool: &MySqlPool) {
    report_backlog(status(pool).await);
}

/// The backlog figures; see [`super::Relay::status`].
pub(super) async fn status(pool: &MySqlPool) -> Result<RelayStatus> {
    Ok(crate::admin::mysql::outbox_status(pool)
        .await?
        .outbox_total())
}

/// One relay instance on MariaDB/MySQL: its session (connection, member slot), its shards.
struct Instance<'r> {
    pool: &'r MySqlPool,
    settings: &'r Settings,
    /// `None` when it only measures the database's work: every row counts as acknowledged.
    transport: Option<&'r dyn Transport>,
    session: Option<Session>,
    shards: BTreeSet<i32>,
    last_rebalance: Option<Instant>,
    published: u64,
}

impl<'r> Instance<'r> {
    fn new(
        pool: &'r MySqlPool,
        settings: &'r Settings,
        transport: Option<&'r dyn Transport>,
    ) -> Self {
        Instance {
            pool,
            settings,
            transport,
            session: None,
            shards: BTreeSet::new(),
            last_rebalance: None,
            published: 0,
        }
    }

    fn owns_shards(&self) -> bool {
        !self.shards.is_empty()
    }

    /// Drops the connection: the server ends the session, its transaction and its locks.
    fn reset(&mut self) {
        self.session = None;
        self.shards.clear();
        self.last_rebalance = None;
    }

    /// Closes the session politely, so that the server frees its shards at once.
    async fn close(&mut self) {
        self.shards.clear();
        if let Some(session) = self.session.take() {
            store::close(session).await;
        }
    }

    /// Publishes batches until one is not full; returns how many rows it published.
    async fn drain(&mut self) -> Result<u64> {
        while let Step::Full = self.step().await? {}
        Ok(self.published)
    }

    /// Rebalances shards when due, then publishes one batch.
    async fn step(&mut self) -> Result<Step> {
        let failover = self.settings.failover_timeout;
        if self
            .last_rebalance
            .is_none_or(|t| t.elapsed() >= REBALANCE_EVERY)
        {
            if self.session.is_none() {
                self.session = Some(bounded!(
                    DATABASE,
                    failover,
                    store::open(self.pool, failover)
                )?);
            }
            let session = self.session.as_mut().expect("opened above");
            let gained = bounded!(
                DATABASE,
                failover,
                store::rebalance(session, &mut self.shards)
            )?;
            tracing::debug!(
                shards = crate::store::shards::shard_mask(&self.shards),
                gained,
                "outbox relay rebalanced"
            );
            self.last_rebalance = Some(Instant::now());
        }
        if self.shards.is_empty() {
            return Ok(Step::Empty);
        }
        let span = super::outcomes::batch_span(self.shards.len());
        // On an error the caller drops the connection (`reset`), which ends the transaction.
        self.batch().instrument(span).await
    }

    async fn batch(&mut self) -> Result<Step> {
        let relay = self.settings;
        let (limit, failover) = (relay.batch_size as i64, relay.failover_timeout);
        let session = self.session.as_mut().expect("opened in step");
        let rows = bounded!(
            DATABASE,
            failover,
            store::claim(session, &self.shards, limit)
        )?;
        tracing::Span::current().record("claimed", rows.len());
        if rows.is_empty() {
            bounded!(DATABASE, failover, store::abandon(session))?;
            return Ok(Step::Empty);
        }
        let started = Instant::now();
        let outcomes = match self.transport {
            Some(transport) => transport.publish(&rows, relay.publishing()).await,
            None => rows.iter().map(|_| Outcome::Published).collect(),
        };
        // No cursor to keep: a row neither published nor recorded is claimed again next time.
        let sorted = super::outcomes::sort(&rows, outcomes, relay);
        let attempts: std::collections::HashMap<i64, i32> =
            rows.iter().map(|r| (r.id, r.attempts)).collect();
        let failed: Vec<_> = sorted
            .failed
            .into_iter()
            .map(|f| {
                let attempts = attempts.get(&f.id).copied().unwrap_or(0);
                (f, attempts)
            })
            .collect();
        let finish = store::finish(
            session,
            &sorted.published,
            &failed,
            relay.max_attempts_i32(),
        );
        let parked = bounded!(DATABASE, failover, finish)?;
        let n = sorted.published.len() as u64;
        self.published += n;
        super::outcomes::count(n, failed.len(), parked, started);
        if let Some(error) = sorted.deferred {
            return Err(Error::Publish(error));
        }
        Ok(if rows.len() as i64 >= limit {
            Step::Full
        } else {
            Step::Partial
        })
    }
}

/// A relay on MariaDB/MySQL that only does the database's work (every row counts as
/// acknowledged): for the benchmark of the database's share.
#[cfg(feature = "testing")]
pub async fn drain_mysql_without_broker(pool: MySqlPool, batch_size: usize) -> Result<u64> {
    let settings = Settings {
        batch_size,
        ..Settings::default()
    };
    super::Relay::new(pool, None, settings)
        .publish_pending()
        .await
}
