//! The operator console: web pages over the outbox and inbox tables (feature `console`).
//!
//! [`router`] returns an axum [`Router`] to mount in the application's own server, or to serve
//! alone (`outbox console` does). Its pages:
//!
//! - **Overview**: per topic, the outbox backlog, retrying, held and parked rows, the oldest
//!   unpublished row's age and the rows published in the last minute; per topic, the inbox's
//!   unprocessed and dead rows; charts of the backlog and the publish rate over the last hour.
//!   The figures are at most one [`sample_interval`](ConsoleSettings::sample_interval) old
//!   (one health check serves every page and tab meanwhile; after an action, the next page
//!   reads them again); the charts are sampled by the console itself at that interval, from its
//!   first request on (the tables keep no history of the backlog): until it has an hour of
//!   samples, their axis starts at the first, and a chart with nothing to draw says why.
//! - **Relays**: the live relay instances (their sessions), the shards each publishes, and the
//!   keys held back by a missing topic or authorization, with the broker's error.
//! - **Parked** outbox rows and **dead** inbox rows, a page at a time (keyset pagination: a
//!   page costs the same with a million rows; each payload summarized, its size and the start
//!   of a small one, so that it costs the same whatever the payloads weigh; a row a line, long
//!   values cut and whole in their title), filtered by topic, event type and time, with
//!   **Retry** and **Skip** (parked) or **Retry** and **Discard** (dead), for one row or a
//!   selection, each behind a confirmation. They call the same functions as the CLI's
//!   `outbox parked` and `outbox inbox dead` commands ([`admin`](crate::admin)), on exactly
//!   the rows selected.
//! - **Find an event** by event id or outbox row id: its outbox row, inbox row and dedup
//!   records; its payload's size, the payload itself up to 32 KiB, a larger one on request
//!   (`/event/payload`, as the relay sends it); a retried row says when and by what.
//!
//! The health warnings ([`admin::health`](crate::admin::health)) are at the top of every page.
//!
//! # Safety
//!
//! The console is read-only unless [`ConsoleSettings::allow_actions`] gives it a token. An
//! operator signs in with the token (kept in a `SameSite=Strict`, `HttpOnly` cookie), or a
//! script sends it as `Authorization: Bearer`. An action is refused without the token, from
//! another site (`Origin`, `Sec-Fetch-Site`), or without the form's anti-forgery field; every
//! action is logged (target `outbox_runtime::console`) with what it changed. No page may be
//! framed by another site. The pages show payloads: mount the router where only operators
//! reach it, and set [`mounted_at`](ConsoleSettings::mounted_at) to the path it is nested at
//! (a console nested elsewhere answers with an error page that says so). Behind a reverse proxy,
//! pass the `Host` header on (nginx: `proxy_set_header Host $host;`): actions and sign-in are
//! refused when the browser's `Origin` names another host than the request.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_runtime::console::{self, ConsoleSettings};
//!
//! let settings = ConsoleSettings::default()
//!     .allow_actions(std::env::var("OUTBOX_CONSOLE_TOKEN")?)
//!     .mounted_at("/ops/outbox");
//! let app = axum::Router::new().nest("/ops/outbox", console::router(pool, settings)?);
//! # let _: axum::Router = app;
//! # Ok(()) }
//! ```

mod auth;
mod chart;
mod handlers;
mod lists;
mod pages;
mod queues;
mod respond;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::{get, post};
use axum::Router;
use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::admin::{Health, HealthThresholds};
use crate::error::{Error, Result};

/// A token shorter than this is refused: it guards actions that change rows.
pub const MIN_TOKEN_LEN: usize = 16;

/// What the console allows and how it behaves. The default is read-only, mounted at the root,
/// with the default health thresholds, sampling every 10 s and 50 rows a page.
#[derive(Clone, PartialEq)]
#[must_use]
pub struct ConsoleSettings {
    token: Option<String>,
    mounted_at: String,
    thresholds: HealthThresholds,
    sample_interval: Duration,
    refresh_interval: Duration,
    page_size: u32,
    queues: Option<queues::Source>,
}

impl std::fmt::Debug for ConsoleSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleSettings")
            .field("actions_allowed", &self.token.is_some())
            .field("mounted_at", &self.mounted_at)
            .field("thresholds", &self.thresholds)
            .field("sample_interval", &self.sample_interval)
            .field("refresh_interval", &self.refresh_interval)
            .field("page_size", &self.page_size)
            .field("queues", &self.queues)
            .finish()
    }
}

impl Default for ConsoleSettings {
    fn default() -> Self {
        ConsoleSettings {
            token: None,
            mounted_at: String::new(),
            thresholds: HealthThresholds::default(),
            sample_interval: Duration::from_secs(10),
            refresh_interval: Duration::from_secs(5),
            page_size: 50,
            queues: None,
        }
    }
}

impl ConsoleSettings {
    /// Allows the actions (retry, skip, discard) to whoever presents this token (at least
    /// [`MIN_TOKEN_LEN`] characters; [`router`] refuses a shorter one).
    pub fn allow_actions(mut self, token: impl Into<String>) -> Self {
        // Spaces or a newline around it (a token read from a file) are not part of it.
        self.token = Some(token.into().trim().to_owned());
        self
    }

    /// Whether actions are allowed.
    pub fn actions_allowed(&self) -> bool {
        self.token.is_some()
    }

    /// The path the router is mounted at (`Router::nest`), which the pages' links start with:
    /// `"/ops/outbox"`, say. Default: the root.
    pub fn mounted_at(mut self, path: impl Into<String>) -> Self {
        self.mounted_at = path.into().trim_end_matches('/').to_owned();
        self
    }

    /// When figures become the warnings at the top of every page.
    pub fn health_thresholds(mut self, thresholds: HealthThresholds) -> Self {
        self.thresholds = thresholds;
        self
    }

    /// How often the console samples the figures its charts draw (default 10 s; the charts
    /// keep the last hour).
    pub fn sample_interval(mut self, interval: Duration) -> Self {
        self.sample_interval = interval;
        self
    }

    /// How often the pages' figures refresh on their own, with JavaScript (default 5 s).
    pub fn refresh_interval(mut self, interval: Duration) -> Self {
        self.refresh_interval = interval;
        self
    }

    /// Rows on a page of parked or dead rows (default 50, at most 1,000).
    pub fn page_size(mut self, rows: u32) -> Self {
        self.page_size = rows;
        self
    }

    /// Shows RabbitMQ's queues on the overview: for each of `groups`, every shard queue of the
    /// topics the figures name (or of [`rabbitmq_topics`](Self::rabbitmq_topics)) with its
    /// ready messages and consumers, its delay queue and the topic's dead-letter queue; a
    /// missing queue, or a shard queue no consumer reads, is called out. `rabbitmq`'s shard
    /// count must be the consumers'.
    #[cfg(feature = "rabbitmq")]
    #[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
    pub fn rabbitmq_queues(
        mut self,
        rabbitmq: crate::rabbitmq::RabbitMq,
        groups: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        let topics = match self.queues.take() {
            Some(queues::Source::RabbitMq { topics, .. }) => topics,
            None => Vec::new(),
        };
        self.queues = Some(queues::Source::RabbitMq {
            settings: rabbitmq,
            groups: groups.into_iter().map(Into::into).collect(),
            topics,
        });
        self
    }

    /// The topics whose RabbitMQ queues the overview shows (default: every topic the figures
    /// name). Only with [`rabbitmq_queues`](Self::rabbitmq_queues).
    #[cfg(feature = "rabbitmq")]
    #[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
    pub fn rabbitmq_topics(mut self, topics: impl IntoIterator<Item = impl Into<String>>) -> Self {
        if let Some(queues::Source::RabbitMq { topics: kept, .. }) = &mut self.queues {
            *kept = topics.into_iter().map(Into::into).collect();
        }
        self
    }

    fn check(&self) -> Result<()> {
        let invalid = |reason: String| Err(Error::Config(format!("console settings: {reason}")));
        if let Some(Err(reason)) = self.queues.as_ref().map(queues::Source::check) {
            return invalid(reason);
        }
        if let Some(token) = &self.token {
            if token.chars().count() < MIN_TOKEN_LEN {
                return invalid(format!(
                    "the actions' token must have at least {MIN_TOKEN_LEN} characters"
                ));
            }
        }
        let path_char = |c: char| c.is_ascii_alphanumeric() || "/-_.~".contains(c);
        if !self.mounted_at.is_empty()
            && (!self.mounted_at.starts_with('/')
                || self.mounted_at.starts_with("//")
                || !self.mounted_at.chars().all(path_char))
        {
            return invalid(format!(
                "mounted_at must be a path such as `/ops/outbox` (letters, digits, `/-_.~`), not `{}`",
                self.mounted_at
            ));
        }
        if !(1..=1000).contains(&self.page_size) {
            return invalid(format!(
                "page_size must be 1 to 1000, not {}",
                self.page_size
            ));
        }
        if self.sample_interval < Duration::from_secs(1)
            || self.refresh_interval < Duration::from_secs(1)
        {
            return invalid("sample_interval and refresh_interval must be at least 1 s".into());
        }
        Ok(())
    }
}

/// The console's pages as an axum `Router`, to mount at
/// [`mounted_at`](ConsoleSettings::mounted_at) (or to serve at the root). Refuses invalid
/// settings. Nothing runs until the first request: then the console starts sampling the
/// figures for its charts, until the router is dropped.
pub fn router(pool: PgPool, settings: ConsoleSettings) -> Result<Router> {
    settings.check()?;
    let console = Arc::new(Console {
        pool,
        settings,
        form_key: uuid::Uuid::new_v4().simple().to_string(),
        started_at: Utc::now(),
        samples: Mutex::new(chart::Samples::default()),
        health: Mutex::new(None),
        acted_at: Mutex::new(None),
        checking: tokio::sync::Mutex::new(()),
        sampler: std::sync::Once::new(),
        sampling: std::sync::atomic::AtomicBool::new(false),
        shard_sets: Mutex::new(Default::default()),
    });
    Ok(Router::new()
        .route("/", get(handlers::overview))
        .route("/relays", get(handlers::relays))
        .route("/parked", get(handlers::parked))
        .route("/parked/retry", post(handlers::parked_retry))
        .route("/parked/skip", post(handlers::parked_skip))
        .route("/dead", get(handlers::dead))
        .route("/dead/retry", post(handlers::dead_retry))
        .route("/dead/discard", post(handlers::dead_discard))
        .route("/event", get(handlers::event))
        .route("/event/payload", get(handlers::event_payload))
        .route("/login", get(auth::login_page).post(auth::login))
        .route("/logout", post(auth::logout))
        .route("/assets/console.css", get(handlers::css))
        .route("/assets/console.js", get(handlers::js))
        .fallback(handlers::not_found)
        .layer(axum::middleware::from_fn_with_state(
            console.clone(),
            auth::guard,
        ))
        .with_state(console))
}

/// Each relay instance's shards, and since when they are unchanged, by backend pid.
type ShardSets = std::collections::HashMap<i32, (Vec<i32>, DateTime<Utc>)>;

/// The router's state.
struct Console {
    pool: PgPool,
    settings: ConsoleSettings,
    /// The anti-forgery field of every action form: random per router, so another site cannot
    /// write a form that passes.
    form_key: String,
    started_at: DateTime<Utc>,
    samples: Mutex<chart::Samples>,
    /// The last health check, and when it began: the warnings every page shows.
    health: Mutex<Option<(tokio::time::Instant, Arc<Health>)>>,
    /// When the last action was done: a check that began before it is stale.
    acted_at: Mutex<Option<tokio::time::Instant>>,
    /// Held while a health check runs: requests that find the last one stale wait for the
    /// one under way instead of each running their own.
    checking: tokio::sync::Mutex<()>,
    sampler: std::sync::Once,
    /// Whether the sampler runs (it needs a tokio runtime).
    sampling: std::sync::atomic::AtomicBool,
    /// Each relay instance's shards as last seen, and since when the console has seen them
    /// unchanged (by backend pid).
    shard_sets: Mutex<ShardSets>,
}

impl Console {
    /// A link to one of the console's paths (`/relays`...).
    fn link(&self, path: &str) -> String {
        match (self.settings.mounted_at.as_str(), path) {
            ("", path) => path.to_owned(),
            // `Router::nest("/ops", ..)` serves its `/` at `/ops`.
            (base, "/") => base.to_owned(),
            (base, path) => format!("{base}{path}"),
        }
    }

    /// Starts the sampler on the first request (a router may be built outside a runtime, and
    /// served on one that is not tokio's: then there are no samples, and the charts say so).
    fn start_sampler(self: &Arc<Self>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        self.sampler.call_once(|| {
            self.sampling
                .store(true, std::sync::atomic::Ordering::Relaxed);
            let weak = Arc::downgrade(self);
            let interval = self.settings.sample_interval;
            runtime.spawn(async move {
                let mut ticks = tokio::time::interval(interval);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticks.tick().await;
                    let Some(console) = weak.upgrade() else {
                        return;
                    };
                    if let Err(e) = console.check_health().await {
                        tracing::warn!(
                            target: "outbox_runtime::console",
                            error = %crate::error_chain(&e),
                            "the console could not read the figures for its charts"
                        );
                    }
                }
            });
        });
    }

    /// Runs the health check (with the backlog figures), keeps it for the pages' warnings and
    /// adds a sample to the charts.
    async fn check_health(&self) -> Result<Arc<Health>> {
        let started = tokio::time::Instant::now();
        let health = Arc::new(
            crate::admin::health::health_estimated(&self.pool, &self.settings.thresholds).await?,
        );
        let min_gap = chrono::Duration::from_std(self.settings.sample_interval / 2)
            .unwrap_or(chrono::Duration::MAX);
        self.samples
            .lock()
            .expect("samples")
            .push(Utc::now(), &health.status, min_gap);
        // The newer of two checks that ran at once is kept.
        let mut kept = self.health.lock().expect("health");
        if kept.as_ref().is_none_or(|(at, _)| *at <= started) {
            *kept = Some((started, health.clone()));
        }
        Ok(health)
    }

    /// After an action: the checks that began before it no longer serve a page, so that the
    /// page the operator lands on (and every later one) shows what is true now.
    fn acted(&self) {
        *self.acted_at.lock().expect("acted") = Some(tokio::time::Instant::now());
    }

    /// The latest health check, run again (by one request at a time) if it began longer ago
    /// than the sample interval, or before the last action.
    async fn latest_health(&self) -> Result<Arc<Health>> {
        let fresh = || {
            let acted = *self.acted_at.lock().expect("acted");
            let cached = self.health.lock().expect("health").clone();
            cached
                .filter(|(at, _)| {
                    at.elapsed() < self.settings.sample_interval && acted.is_none_or(|a| *at > a)
                })
                .map(|(_, health)| health)
        };
        if let Some(health) = fresh() {
            return Ok(health);
        }
        let _checking = self.checking.lock().await;
        match fresh() {
            Some(health) => Ok(health),
            None => self.check_health().await,
        }
    }
}
