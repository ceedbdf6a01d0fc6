//! [`Relay`]: the run loop of an instance (claim, publish, mark; wait for work; back off).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::gauges::{report_backlog, Owning, GAUGES_EVERY};
use super::health::HealthChecks;
use super::instance::{Instance, Step, REBALANCE_EVERY};
use super::periodic::RetentionRuns;
use super::settings::Settings;
use super::wakeup::Wakeups;
use super::{status, RelayStatus};
use crate::error::{Error, Result};
use crate::publish::Transport;
use crate::store::database::{Database, Pool};

/// Publishes the outbox to Kafka or JetStream. Cheap to clone; every [`run`](Self::run) or
/// [`spawn`](Self::spawn) is one more instance sharing the producer. See the
/// [module documentation](super) for how it works.
#[derive(Clone)]
pub struct Relay {
    shared: Arc<Shared>,
}

/// What a relay's instances share.
struct Shared {
    pool: Pool,
    /// `None` only in `drain_without_broker`, which measures the database side alone.
    transport: Option<Box<dyn Transport>>,
    settings: Settings,
    health: HealthChecks,
    /// Retention, if it runs here, and when next.
    retention: Option<RetentionRuns>,
    /// How many of its running instances own shards (for [`Relay::ready`]).
    owning: AtomicUsize,
    /// The broker's last answer to [`Relay::ready`], and when.
    broker_answer: tokio::sync::Mutex<Option<(Instant, std::result::Result<(), String>)>>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.shared.settings;
        f.debug_struct("Relay")
            .field("batch_size", &s.batch_size)
            .field("poll_interval", &s.poll_interval)
            .field("publish_timeout", &s.publish_timeout)
            .field("failover_timeout", &s.failover_timeout)
            .field("max_attempts", &s.max_attempts)
            .finish_non_exhaustive()
    }
}

impl Relay {
    pub(super) fn new(
        pool: impl Into<Database>,
        transport: Option<Box<dyn Transport>>,
        settings: Settings,
    ) -> Relay {
        let health = HealthChecks::new(settings.health.clone(), settings.health_interval);
        let retention = settings.retention.clone().map(RetentionRuns::new);
        Relay {
            shared: Arc::new(Shared {
                pool: pool.into().0,
                transport,
                settings,
                health,
                retention,
                owning: AtomicUsize::new(0),
                broker_answer: tokio::sync::Mutex::new(None),
            }),
        }
    }

    /// A new instance of this relay on PostgreSQL.
    fn instance<'a>(&'a self, pool: &'a PgPool) -> Instance<'a> {
        let shared = &*self.shared;
        Instance::new(pool, &shared.settings, shared.transport.as_deref())
    }

    /// Runs one relay instance on a tokio task until `cancel` fires; see [`run`](Self::run).
    pub fn spawn(&self, cancel: CancellationToken) -> JoinHandle<Result<()>> {
        let relay = self.clone();
        tokio::spawn(async move { relay.run(cancel).await })
    }

    /// Runs one relay instance until `cancel` fires: publishes as events commit (claiming
    /// again at once while claims find rows; once one finds nothing, woken by NOTIFY, and
    /// polling every `poll_interval`), retries with backoff on errors (a lost
    /// database or broker, a producer that failed for good). On cancel it finishes the batch in
    /// flight (bounded by the publish timeout) and returns. Errors are logged and retried, never
    /// returned.
    pub async fn run(&self, cancel: CancellationToken) -> Result<()> {
        match &self.shared.pool {
            Pool::Postgres(pool) => self.run_on(pool, cancel).await,
            #[cfg(feature = "mysql")]
            Pool::MySql(pool) => {
                let shared = &*self.shared;
                let transport = shared.transport.as_deref();
                // The health checks and retention, when due, each on a task of its own (as on
                // PostgreSQL).
                let periodic = || {
                    if shared.health.claim_due() {
                        let (shared, pool) = (Arc::clone(&self.shared), pool.clone());
                        tokio::spawn(async move { shared.health.check_mysql(&pool).await });
                    }
                    if shared
                        .retention
                        .as_ref()
                        .is_some_and(RetentionRuns::claim_due)
                    {
                        let (shared, pool) = (Arc::clone(&self.shared), pool.clone());
                        tokio::spawn(async move {
                            if let Some(retention) = &shared.retention {
                                retention.run_mysql(&pool).await;
                            }
                        });
                    }
                };
                let parts = super::mysql::Parts {
                    settings: &shared.settings,
                    transport,
                    owning: &shared.owning,
                    periodic: &periodic,
                };
                super::mysql::run(parts, pool, cancel).await
            }
        }
    }

    /// [`run`](Self::run) on PostgreSQL.
    async fn run_on(&self, pool: &PgPool, cancel: CancellationToken) -> Result<()> {
        let settings = &self.shared.settings;
        let mut instance = self.instance(pool);
        let mut wakeups = Wakeups::start(pool, settings.failover_timeout, settings.backoff);
        let mut failures = 0u32;
        // Whether the last claim found rows.
        let mut found_rows = false;
        let mut gauges_at: Option<Instant> = None;
        let mut owning = Owning {
            count: &self.shared.owning,
            owns: false,
        };
        // What the pool is asked for besides the instance's own connection must not stall the
        // loop while the database is away: a lost gauge costs nothing.
        let aside = settings.poll_interval.max(Duration::from_secs(1));
        // A partitioned outbox's partitions, kept created ahead also where no relay runs
        // retention (emits fail once they run out); stopped when this instance returns.
        let keeping = cancel.child_token();
        tokio::spawn(crate::admin::partitions::keep_ahead(
            pool.clone(),
            crate::admin::CleanupTable::Outbox,
            keeping.clone(),
        ));
        if !settings.claim_floor_interval.is_zero() {
            let floor = Arc::new(super::floor::Floor::default());
            instance.use_floor(Arc::clone(&floor));
            tokio::spawn(super::floor::keep(
                pool.clone(),
                floor,
                settings.claim_floor_interval,
                settings.claim_floor_margin,
                keeping.clone(),
            ));
        }
        let _keeping = keeping.drop_guard();
        while !cancel.is_cancelled() {
            if gauges_at.is_none_or(|t| t.elapsed() >= GAUGES_EVERY) {
                gauges_at = Some(Instant::now());
                let _ = tokio::time::timeout(aside, report_pg_backlog(pool)).await;
            }
            if self.shared.health.claim_due() {
                let (shared, pool) = (Arc::clone(&self.shared), pool.clone());
                tokio::spawn(async move { shared.health.check(&pool).await });
            }
            if self
                .shared
                .retention
                .as_ref()
                .is_some_and(RetentionRuns::claim_due)
            {
                let (shared, pool) = (Arc::clone(&self.shared), pool.clone());
                tokio::spawn(async move {
                    if let Some(retention) = &shared.retention {
                        retention.run(&pool).await;
                    }
                });
            }
            // Notifications from here on may be of rows this step's claim does not see.
            wakeups.mark_seen();
            let step = instance.step().await;
            owning.set(instance.owns_shards());
            match step {
                Ok(step @ (Step::Full | Step::Partial)) => {
                    failures = 0;
                    // Events are coming: claim again at once. Once they keep coming (a full
                    // batch, or rows found twice in a row), emitters need not notify: a
                    // notifying commit takes a database-wide lock that serializes them.
                    if step == Step::Full || found_rows {
                        if let Err(e) = instance.set_waiting(false).await {
                            tracing::warn!(error = %crate::error_chain(&e), "outbox relay could not clear its waiting mark");
                            instance.reset();
                        }
                    }
                    found_rows = true;
                    continue;
                }
                Ok(Step::Empty) => {
                    failures = 0;
                    found_rows = false;
                    // About to wait: ask emitters to notify, then look once more, for rows
                    // committed before they could see the mark.
                    if !instance.waiting() && instance.owns_shards() {
                        match instance.set_waiting(true).await {
                            Ok(()) => continue,
                            Err(e) => {
                                tracing::warn!(error = %crate::error_chain(&e), "outbox relay could not mark itself waiting");
                                instance.reset();
                            }
                        }
                    }
                    // Without shards, look again soon: another instance is about to free some.
                    // With them, soon enough that the server does not take the session for a
                    // dead one.
                    let wait = if instance.owns_shards() {
                        settings.poll_interval.min(settings.failover_timeout / 2)
                    } else {
                        settings.poll_interval.min(REBALANCE_EVERY)
                    };
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        () = tokio::time::sleep(wait) => {}
                        () = wakeups.notified() => {}
                    }
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    found_rows = false;
                    let backoff = settings.backoff.jittered(failures);
                    tracing::warn!(error = %crate::error_chain(&e), ?backoff, "outbox relay batch failed; retrying");
                    metrics::counter!("outbox_relay_batch_failures_total").increment(1);
                    instance.reset();
                    owning.set(false);
                    if matches!(e, Error::Database(_)) && e.is_transient() {
                        // A lost connection: the listener's is probably gone too.
                        wakeups.reconnect();
                    }
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        () = tokio::time::sleep(backoff) => {}
                    }
                }
            }
        }
        if let Err(e) = instance.set_waiting(false).await {
            tracing::debug!(error = %crate::error_chain(&e), "outbox relay could not clear its waiting mark on shutdown");
        }
        // Every batch waited for its own acknowledgements: nothing to flush. Records a timed-out
        // batch left with the producer stay unpublished in the outbox; whoever publishes them
        // next sends them again.
        Ok(())
    }

    /// Publishes everything unpublished that this instance can own, once, and returns how many
    /// rows it published. For tests, scripts and benchmarks; a failed batch is an error.
    pub async fn publish_pending(&self) -> Result<u64> {
        let pool = match &self.shared.pool {
            Pool::Postgres(pool) => pool,
            #[cfg(feature = "mysql")]
            Pool::MySql(pool) => {
                let transport = self.shared.transport.as_deref();
                return super::mysql::publish_pending(&self.shared.settings, transport, pool).await;
            }
        };
        let mut instance = self.instance(pool);
        let settings = &self.shared.settings;
        if !settings.claim_floor_interval.is_zero() {
            // The floor of the start (waiting at most a second for the transactions running
            // then): a row that becomes claimable below it meanwhile waits for the next run.
            let floor = super::floor::claim_floor(
                pool,
                settings.claim_floor_margin,
                Duration::from_secs(1),
            )
            .await?;
            if let Some(floor) = floor {
                instance.use_floor(Arc::new(super::floor::Floor::at(floor)));
            }
        }
        while let Step::Full = instance.step().await? {}
        Ok(instance.published())
    }

    /// Whether this relay can publish, for a readiness probe: the database answers, the broker
    /// answers (its metadata, within 4 s; the answer is kept 5 s), and one of the relay's
    /// running instances owns shards.
    /// `Ok` says what was checked; `Err` says what failed. [`serve_prometheus_for_relay`]
    /// serves it at `/ready`.
    ///
    /// [`serve_prometheus_for_relay`]: crate::serve_prometheus_for_relay
    pub async fn ready(&self) -> std::result::Result<String, String> {
        const WITHIN: Duration = Duration::from_secs(4);
        let database = async {
            let answer = async {
                match &self.shared.pool {
                    Pool::Postgres(pool) => sqlx::query("SELECT 1").execute(pool).await.map(drop),
                    #[cfg(feature = "mysql")]
                    Pool::MySql(pool) => sqlx::query("SELECT 1").execute(pool).await.map(drop),
                }
            };
            match tokio::time::timeout(WITHIN, answer).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("the database: {}", crate::error_chain(&e))),
                Err(_) => Err(format!(
                    "the database did not answer within {WITHIN:?} (or the pool had no free \
                     connection)"
                )),
            }
        };
        let (database, broker) = tokio::join!(database, self.broker_answers(WITHIN));
        let owning = self.shared.owning.load(Ordering::Relaxed);
        let shards = if owning == 0 {
            Err("no instance of this relay owns shards (yet)".to_owned())
        } else {
            Ok(())
        };
        let failed: Vec<String> = [database, broker, shards]
            .into_iter()
            .filter_map(std::result::Result::err)
            .collect();
        if failed.is_empty() {
            Ok(format!(
                "the database and the broker answer; {owning} instance(s) own shards"
            ))
        } else {
            Err(failed.join("; "))
        }
    }

    /// Whether the broker answers a metadata request within `within`; the answer is kept for
    /// [`BROKER_ANSWER_KEPT`], so that frequent probes cost the cluster one request per period.
    async fn broker_answers(&self, within: Duration) -> std::result::Result<(), String> {
        let Some(transport) = &self.shared.transport else {
            return Ok(());
        };
        if let Some((at, answer)) = &*self.shared.broker_answer.lock().await {
            if at.elapsed() < BROKER_ANSWER_KEPT {
                return answer.clone();
            }
        }
        let answer = transport.ready(within).await;
        *self.shared.broker_answer.lock().await = Some((Instant::now(), answer.clone()));
        answer
    }

    /// The backlog figures, all topics together (per topic: [`admin::status`](crate::admin::status)).
    pub async fn status(&self) -> Result<RelayStatus> {
        match &self.shared.pool {
            Pool::Postgres(pool) => status(pool).await,
            #[cfg(feature = "mysql")]
            Pool::MySql(pool) => super::mysql::status(pool).await,
        }
    }
}

/// Runs the relay's database work alone (claim, mark, commit; every row counts as
/// acknowledged, nothing is sent to any broker) until nothing is left, and returns how many rows
/// it marked. For the benchmark that measures the database's share of the relay's cost.
#[cfg(feature = "testing")]
pub async fn drain_without_broker(pool: PgPool, batch_size: usize) -> Result<u64> {
    let settings = Settings {
        batch_size,
        ..Settings::default()
    };
    Relay::new(pool, None, settings).publish_pending().await
}

/// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` of one claim of `limit` rows of every shard after
/// `cursor`, on a connection set up as a relay's (and rolled back). For the tests that check a
/// claim's cost does not grow with the backlog.
#[cfg(feature = "testing")]
pub async fn explain_claim(pool: &PgPool, cursor: i64, limit: i64) -> Result<serde_json::Value> {
    let settings = Settings {
        batch_size: limit as usize,
        ..Settings::default()
    };
    Instance::new(pool, &settings, None)
        .explain_claim(cursor)
        .await
}

/// How long [`Relay::ready`] keeps the broker's answer.
const BROKER_ANSWER_KEPT: Duration = Duration::from_secs(5);

/// Sets the backlog gauges from PostgreSQL's figures.
async fn report_pg_backlog(pool: &PgPool) {
    report_backlog(status(pool).await);
}
