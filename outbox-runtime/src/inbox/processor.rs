//! Inbox mode's processors: each holds a share of the keys' shards (`shards.rs`), claims due
//! rows of its shards (and of no key) in their keys' order and runs their handlers, marking
//! them processed in the same transaction, on the connection that holds the shards (a row that
//! fails gets an attempt, its error and a retry time, or is dead); a processor that stops on
//! its own is restarted. The statements are `store/inbox.rs`'s.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Connection;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use super::batch::discard;
use super::database::Conn;
use super::failure::Failure;
use super::ladder::{self, Batch, Pass, Settled};
use super::meta::MessageMeta;
use super::settings::Settings;
use super::shards::Shards;
use super::shared::Shared;
use crate::error::{Error, Result};
use crate::sqlstate::DbError;
use crate::store::inbox::{self as store, inbox_status, Claimed, ReceivedAt, RowFailure, Scope};

/// Runs an inbox processor on a task, and runs it again if it ever stops before `cancel`
/// (a bug: handler failures and panics are the rows' business, database failures are
/// waited out), so that receipt never goes on storing offsets with nothing processing.
pub(crate) fn spawn_supervised(
    shared: Arc<Shared>,
    cancel: CancellationToken,
) -> JoinHandle<Result<()>> {
    tokio::spawn(async move {
        let mut restarts = 0;
        loop {
            let processor = Arc::clone(&shared);
            let token = cancel.clone();
            let ended = tokio::spawn(async move { run(&processor, token).await }).await;
            if cancel.is_cancelled() {
                return match ended {
                    Ok(result) => result,
                    Err(source) => Err(Error::Task {
                        task: "an inbox processor",
                        source,
                    }),
                };
            }
            restarts += 1;
            metrics::counter!("outbox_inbox_processor_restarts_total").increment(1);
            match ended {
                Ok(Ok(())) => tracing::error!("an inbox processor stopped; restarting it"),
                Ok(Err(e)) => {
                    tracing::error!(error = %crate::error_chain(&e), "an inbox processor failed; restarting it")
                }
                Err(e) => {
                    tracing::error!(error = %crate::error_chain(&e), "an inbox processor panicked; restarting it")
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return Ok(()),
                () = tokio::time::sleep(shared.settings.outage_backoff(restarts)) => {}
            }
        }
    })
}

/// Runs one inbox processor until `cancel` fires.
pub(crate) async fn run(shared: &Shared, cancel: CancellationToken) -> Result<()> {
    let settings = &shared.settings;
    let mut failures = 0;
    let mut gauges_at: Option<std::time::Instant> = None;
    let mut rows_waiting = shared.rows_waiting.subscribe();
    let mut shards = Shards::detached();
    // After a wait: its share of the shards is looked at before the claim.
    let mut woken = true;
    while !cancel.is_cancelled() {
        if gauges_at.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
            gauges_at = Some(std::time::Instant::now());
            match inbox_status(shared.pg()).await {
                Ok(s) => {
                    metrics::gauge!("outbox_inbox_backlog").set(s.unprocessed as f64);
                    metrics::gauge!("outbox_inbox_dead").set(s.dead as f64);
                    metrics::gauge!("outbox_inbox_lag_seconds")
                        .set(s.oldest_unprocessed_age.map_or(0.0, |a| a.as_secs_f64()));
                }
                Err(e) => {
                    tracing::debug!(error = %crate::error_chain(&e), "cannot read the inbox backlog")
                }
            }
        }
        // What is stored or released from here on wakes it from the wait below.
        rows_waiting.mark_unchanged();
        let batch = process_batch(shared, &mut shards, woken).await;
        // Only after a full batch does it go straight on, with no wait.
        woken = !matches!(batch, Ok(n) if n >= settings.batch_size);
        match batch {
            Ok(n) if n >= settings.batch_size => failures = 0,
            Ok(_) => {
                failures = 0;
                tokio::select! {
                    () = cancel.cancelled() => {}
                    () = tokio::time::sleep(settings.poll_interval) => {}
                    _ = rows_waiting.changed() => {}
                }
            }
            Err(e) => {
                failures += 1;
                // Its connection may be what failed: a new one holds the shards next time.
                shards.reset();
                tracing::warn!(error = %crate::error_chain(&e), "inbox processor batch failed; retrying");
                tokio::select! {
                    () = cancel.cancelled() => {}
                    () = tokio::time::sleep(settings.outage_backoff(failures)) => {}
                }
            }
        }
    }
    Ok(())
}

/// Processes the inbox until no row is due to it (rows of shards other processors hold are
/// theirs), once, and returns how many rows it handled (processed or failed). Before it ends
/// it takes the shards no one holds and goes on while they have rows: its fair share may have
/// left some to a processor that held none yet, or has ended since (another one-off run).
pub(crate) async fn process_pending(shared: &Shared) -> Result<u64> {
    let mut shards = Shards::pooled();
    let mut total = 0;
    loop {
        let n = process_batch(shared, &mut shards, total == 0).await?;
        total += n as u64;
        if n == 0 && !shards.take_free().await? {
            shards.release().await?;
            return Ok(total);
        }
    }
}

/// Failures already seen, by row: not run again.
type Known = ladder::Known<Uuid>;

/// Claims a batch of due rows and processes it down the [`ladder`]: first in one transaction
/// (every handler straight in it); if a handler fails, panics or leaves the transaction
/// aborted, again with a savepoint per row, so a failing row undoes only its own work and
/// records its failure; if the commit is refused (a deferred constraint), each row in a
/// transaction of its own. Returns how many rows it claimed. `woken`: after a wait, when its
/// share of the shards is looked at whatever the time.
async fn process_batch(shared: &Shared, shards: &mut Shards, woken: bool) -> Result<usize> {
    shards.ready(shared.pg(), woken).await?;
    ladder::handle(&mut Rows {
        shared,
        shards,
        only: None,
    })
    .await
}

/// The due rows a processor claims (`only`: just these), as the [`ladder`] handles them.
struct Rows<'a> {
    shared: &'a Shared,
    shards: &'a mut Shards,
    only: Option<&'a [Uuid]>,
}

impl Batch for Rows<'_> {
    type Key = Uuid;
    /// Rows claimed.
    type Handled = usize;
    type Error = crate::Error;

    async fn together(&mut self, _known: &mut Known) -> Result<Pass<Uuid, usize>> {
        process_optimistic(self.shared, self.shards).await
    }

    async fn isolated(&mut self, known: &Known) -> Result<Pass<Uuid, usize>> {
        process_isolated(self.shared, self.shards, known, self.only).await
    }

    /// Each due row in a transaction of its own, so the refusal falls on its row, whose
    /// failure is then recorded in a transaction of its own.
    async fn one_by_one(&mut self, known: &Known) -> Result<usize> {
        let shared = self.shared;
        let mask = self.shards.mask();
        let ids = store::due_ids(self.shards.conn(), shared.settings.batch_size, mask).await?;
        for id in &ids {
            let seen: Known = known
                .get(id)
                .map(|f| (*id, f.clone()))
                .into_iter()
                .collect();
            let mut one = Rows {
                shared,
                shards: &mut *self.shards,
                only: Some(std::slice::from_ref(id)),
            };
            if let Err(refused) = ladder::alone(&mut one, seen).await? {
                let conn = self.shards.conn();
                let attempts = store::attempts(&mut *conn, *id).await?;
                let failure = Failure::refused_at_commit(&refused);
                let failure = RowFailure::new(&shared.settings, *id, attempts, &failure);
                let mut tx = conn.begin().await?;
                store::record_failures(&mut tx, &[failure]).await?;
                tx.commit().await?;
            }
        }
        Ok(ids.len())
    }
}

/// Begins a batch's transaction on the connection that holds `shards` (`store::BEGIN_SQL`: at
/// READ COMMITTED, so its claim sees what the shards' previous holders committed; the planner
/// held to index scans for the claim alone), and claims its rows from `floor`.
async fn begin<'c>(
    shared: &Shared,
    shards: &'c mut Shards,
    only: Option<&[Uuid]>,
    floor: i64,
) -> Result<(sqlx::Transaction<'c, sqlx::Postgres>, Vec<Claimed>)> {
    let scope = Scope {
        shards: shards.mask(),
        members: shards.members(),
        floor,
    };
    let (conn, restore) = shards.conn_and_restore();
    let mut tx = conn.begin_with(store::BEGIN_SQL).await?;
    let rows = store::claim(&mut tx, shared.settings.batch_size, only, scope, restore).await?;
    Ok((tx, rows))
}

async fn process_optimistic(shared: &Shared, shards: &mut Shards) -> Result<Pass<Uuid, usize>> {
    let routes = &shared.routes;
    let floor = shared.floor.get(shards.conn()).await;
    let (mut tx, rows) = begin(shared, shards, None, floor).await?;
    let mut done: Vec<(Uuid, ReceivedAt)> = Vec::with_capacity(rows.len());
    for row in &rows {
        let meta = row.meta();
        let span = super::meta::parented(
            tracing::info_span!("outbox_inbox_row", event_id = %row.event_id, topic = %row.topic),
            &meta,
        );
        for route in routes.get(&row.topic, &row.event_type) {
            let result = route
                .handle(row.payload.as_bytes(), Conn::Postgres(&mut tx), &meta)
                .instrument(span.clone())
                .await;
            if let Err(failure) = result {
                discard(tx).await;
                return Ok(Pass::Failed(row.event_id, failure));
            }
        }
        done.push((row.event_id, row.received_at));
    }
    if !done.is_empty() {
        if let Err(e) = store::mark_processed(&mut tx, &done).await {
            discard(tx).await;
            return match e {
                Error::Database(e) if DbError::of(&e) == DbError::Aborted => Ok(Pass::Aborted),
                e => Err(e),
            };
        }
    }
    match crate::uow::commit_checked(tx).await {
        Ok(()) => {}
        Err(Error::Aborted { .. }) => return Ok(Pass::Aborted),
        Err(Error::Commit { source, .. }) => return Ok(Pass::Refused(source)),
        Err(e) => return Err(e),
    }
    metrics::counter!("outbox_inbox_processed_total").increment(done.len() as u64);
    Ok(Pass::Done(rows.len()))
}

impl Claimed {
    /// The metadata its handlers get.
    fn meta(&self) -> MessageMeta<'_> {
        MessageMeta {
            event_id: self.event_id,
            event_type: std::borrow::Cow::Borrowed(&self.event_type),
            topic: &self.topic,
            partition: self.partition,
            offset: self.offset,
            key: self.partition_key.as_deref().map(str::as_bytes),
            headers: self
                .headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_bytes()))
                .collect(),
            attempt: u32::try_from(self.attempts).unwrap_or(0).saturating_add(1),
            schema_version: u32::try_from(self.schema_version).unwrap_or(1).max(1),
        }
    }
}

impl RowFailure {
    fn new(settings: &Settings, event_id: Uuid, attempts: i32, failure: &Failure) -> RowFailure {
        let attempt = u32::try_from(attempts).unwrap_or(0) + 1;
        let dead = failure.is_permanent() || attempt >= settings.max_attempts;
        tracing::warn!(
            attempt,
            dead,
            error = failure.message(),
            "inbox handler failed"
        );
        RowFailure {
            event_id,
            error: failure.message().to_owned(),
            backoff_secs: settings.backoff(attempt).as_secs_f64(),
            dead,
        }
    }
}

/// One transaction, a savepoint per row; `only`: just these rows.
async fn process_isolated(
    shared: &Shared,
    shards: &mut Shards,
    known: &Known,
    only: Option<&[Uuid]>,
) -> Result<Pass<Uuid, usize>> {
    let routes = &shared.routes;
    // Rows picked by id (`due_ids`, which reads from the bottom) are claimed without a floor.
    let floor = match only {
        None => shared.floor.get(shards.conn()).await,
        Some(_) => super::floor::NONE,
    };
    let (mut tx, rows) = begin(shared, shards, only, floor).await?;
    let claimed = rows.len();
    let mut done: Vec<(Uuid, ReceivedAt)> = Vec::with_capacity(claimed);
    let mut failed: Vec<RowFailure> = Vec::new();
    // Keys with a row that failed in this batch: their later rows wait for it (left as they
    // are, held back by it once its failure is recorded).
    let mut held_back: HashSet<(String, String)> = HashSet::new();
    for row in rows {
        let key = row.partition_key.clone().map(|k| (row.topic.clone(), k));
        if key.as_ref().is_some_and(|k| held_back.contains(k)) {
            continue;
        }
        let meta = row.meta();
        let span = super::meta::parented(
            tracing::info_span!("outbox_inbox_row", event_id = %row.event_id,
                topic = %row.topic, attempt = row.attempts + 1),
            &meta,
        );
        // Its own savepoint: a failure undoes this row's work only.
        let mut savepoint = Connection::begin(&mut *tx).await?;
        let mut result = Ok(());
        match known.get(&row.event_id) {
            Some(failure) => result = Err(failure.clone()),
            None => {
                for route in routes.get(&row.topic, &row.event_type) {
                    result = route
                        .handle(
                            row.payload.as_bytes(),
                            Conn::Postgres(&mut savepoint),
                            &meta,
                        )
                        .instrument(span.clone())
                        .await;
                    if result.is_err() {
                        break;
                    }
                }
            }
        }
        let reused = known.contains_key(&row.event_id);
        let names = || {
            let names: Vec<&str> = routes
                .get(&row.topic, &row.event_type)
                .iter()
                .map(|r| r.handler.name())
                .collect();
            names.join("`, `")
        };
        let failure = match ladder::settle(savepoint, result, reused, names).await? {
            Settled::Kept => {
                done.push((row.event_id, row.received_at));
                continue;
            }
            Settled::Undone(failure) => failure,
            Settled::Panicked(failure) => {
                discard(tx).await;
                return Ok(Pass::Failed(row.event_id, failure));
            }
        };
        failed.push(RowFailure::new(
            &shared.settings,
            row.event_id,
            row.attempts,
            &failure,
        ));
        held_back.extend(key);
    }
    if !done.is_empty() {
        store::mark_processed(&mut tx, &done).await?;
    }
    store::record_failures(&mut tx, &failed).await?;
    match crate::uow::commit_checked(tx).await {
        Ok(()) => {}
        Err(Error::Commit { source, .. }) => return Ok(Pass::Refused(source)),
        Err(e) => return Err(e),
    }
    metrics::counter!("outbox_inbox_processed_total").increment(done.len() as u64);
    metrics::counter!("outbox_consumer_retried_total")
        .increment(failed.iter().filter(|f| !f.dead).count() as u64);
    metrics::counter!("outbox_inbox_dead_total")
        .increment(failed.iter().filter(|f| f.dead).count() as u64);
    Ok(Pass::Done(claimed))
}
