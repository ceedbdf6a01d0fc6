//! The consumer's SQL: deduplicated handling, inbox receipt and processing, status.

use std::time::Duration;

use sqlx::{Connection, PgPool, Row};
use tracing::Instrument;
use uuid::Uuid;

use super::consumer::Inner;
use super::handler::{ErasedHandler, Failure, Routes};
use crate::error::{Error, Result};

pub(crate) enum DedupError {
    /// The database failed (not the message): retry without counting an attempt.
    Database(Error),
    /// The handler (or deserialization) failed.
    Handler(Failure),
}

/// One transaction: the dedup row, and the handler only if the row is new. `Ok(false)` for a
/// duplicate.
pub(crate) async fn run_deduplicated(
    pool: &PgPool,
    handler: &dyn ErasedHandler,
    event_id: Uuid,
    payload: &[u8],
) -> std::result::Result<bool, DedupError> {
    let db = |e: sqlx::Error| DedupError::Database(e.into());
    let mut tx = pool.begin().await.map_err(db)?;
    let new = sqlx::query(
        "INSERT INTO processed_event (event_id, handler) VALUES ($1, $2) ON CONFLICT DO NOTHING",
    )
    .bind(event_id)
    .bind(handler.name())
    .execute(&mut *tx)
    .await
    .map_err(db)?
    .rows_affected()
        == 1;
    if !new {
        tx.rollback().await.map_err(db)?;
        return Ok(false);
    }
    handler
        .handle_json(payload, &mut tx)
        .await
        .map_err(DedupError::Handler)?;
    tx.commit().await.map_err(db)?;
    Ok(true)
}

/// What became of a dedup batch.
pub(crate) struct BatchOutcome {
    /// Messages from the start of the batch that are done (committed or dead-lettered).
    pub done: usize,
    /// Messages (by index) to dead-letter, with the reason.
    pub dead: Vec<(usize, String)>,
    /// The message at `done` failed retryably: retry it on its own.
    pub retry: bool,
    pub processed: u64,
    pub duplicates: u64,
}

impl BatchOutcome {
    fn all_done(messages: usize) -> Self {
        BatchOutcome {
            done: messages,
            dead: Vec::new(),
            retry: false,
            processed: 0,
            duplicates: 0,
        }
    }
}

/// Dedup mode, the fast path: all the batch's dedup rows in one statement, then the handlers of
/// the new ones, all in one transaction. If a handler fails, nothing is committed and the
/// failure is returned (`Err`): the caller then takes [`dedup_batch`], which isolates failures
/// with savepoints and does not run that handler on that message again.
pub(crate) async fn dedup_batch_optimistic(
    pool: &PgPool,
    routes: &Routes,
    messages: &[rdkafka::message::BorrowedMessage<'_>],
) -> Result<std::result::Result<BatchOutcome, KnownFailure>> {
    use rdkafka::Message as _;
    use std::collections::HashSet;
    let mut outcome = BatchOutcome::all_done(messages.len());
    let mut work = Vec::new();
    for (i, msg) in messages.iter().enumerate() {
        match super::consumer::check(msg) {
            Ok(incoming) => {
                for handler in routes.get(msg.topic(), &incoming.event_type) {
                    work.push((incoming.event_id, handler.clone(), incoming.payload, i));
                }
            }
            Err(reason) => outcome.dead.push((i, reason)),
        }
    }
    if work.is_empty() {
        return Ok(Ok(outcome));
    }
    let ids: Vec<Uuid> = work.iter().map(|w| w.0).collect();
    let names: Vec<&str> = work.iter().map(|w| w.1.name()).collect();
    let mut tx = pool.begin().await?;
    let new: Vec<(Uuid, String)> = sqlx::query_as(
        "INSERT INTO processed_event (event_id, handler) \
         SELECT * FROM unnest($1::uuid[], $2::text[]) ON CONFLICT DO NOTHING \
         RETURNING event_id, handler",
    )
    .bind(&ids)
    .bind(&names)
    .fetch_all(&mut *tx)
    .await?;
    let mut new: HashSet<(Uuid, String)> = new.into_iter().collect();
    for (event_id, handler, payload, i) in &work {
        // Each new row runs its handler once, even if the batch holds the event twice.
        if !new.remove(&(*event_id, handler.name().to_owned())) {
            outcome.duplicates += 1;
            continue;
        }
        let span = tracing::info_span!("outbox_consume", %event_id, handler = handler.name());
        if let Err(failure) = handler.handle_json(payload, &mut tx).instrument(span).await {
            tx.rollback().await?;
            return Ok(Err(KnownFailure {
                index: *i,
                handler: handler.name(),
                failure,
            }));
        }
        outcome.processed += 1;
    }
    tx.commit().await?;
    Ok(Ok(outcome))
}

/// A handler failure already seen (on the optimistic pass), so as not to run it twice for one
/// attempt.
pub(crate) struct KnownFailure {
    /// The message's index in the batch.
    pub index: usize,
    pub handler: &'static str,
    pub failure: Failure,
}

/// Dedup mode, many messages in one transaction: per message and handler a savepoint with the
/// dedup row and (if new) the handler. Stops at the first retryable failure, committing what
/// came before it. An error is the database's (nothing of the batch committed).
pub(crate) async fn dedup_batch(
    pool: &PgPool,
    routes: &Routes,
    messages: &[rdkafka::message::BorrowedMessage<'_>],
    mut known: Option<KnownFailure>,
) -> Result<BatchOutcome> {
    use rdkafka::Message as _;
    let mut tx = pool.begin().await?;
    let mut outcome = BatchOutcome::all_done(messages.len());
    'messages: for (i, msg) in messages.iter().enumerate() {
        let incoming = match super::consumer::check(msg) {
            Ok(incoming) => incoming,
            Err(reason) => {
                outcome.dead.push((i, reason));
                continue;
            }
        };
        for handler in routes.get(msg.topic(), &incoming.event_type) {
            let seen = known
                .take_if(|k| k.index == i && k.handler == handler.name())
                .map(|k| k.failure);
            let mut savepoint = Connection::begin(&mut *tx).await?;
            let new = sqlx::query(
                "INSERT INTO processed_event (event_id, handler) VALUES ($1, $2) \
                 ON CONFLICT DO NOTHING",
            )
            .bind(incoming.event_id)
            .bind(handler.name())
            .execute(&mut *savepoint)
            .await?
            .rows_affected()
                == 1;
            if !new {
                savepoint.commit().await?;
                outcome.duplicates += 1;
                continue;
            }
            let span = tracing::info_span!("outbox_consume", topic = msg.topic(),
                partition = msg.partition(), offset = msg.offset(), event_id = %incoming.event_id,
                handler = handler.name());
            let result = match seen {
                Some(failure) => Err(failure),
                None => {
                    handler
                        .handle_json(incoming.payload, &mut savepoint)
                        .instrument(span)
                        .await
                }
            };
            match result {
                Ok(()) => {
                    savepoint.commit().await?;
                    outcome.processed += 1;
                }
                Err(Failure::Permanent(reason)) => {
                    savepoint.rollback().await?;
                    outcome.dead.push((i, reason));
                }
                Err(Failure::Retryable(_)) => {
                    savepoint.rollback().await?;
                    outcome.done = i;
                    outcome.retry = true;
                    break 'messages;
                }
            }
        }
    }
    tx.commit().await?;
    Ok(outcome)
}

/// A checked message, ready to store in the inbox.
pub(crate) struct InboxRow<'m> {
    pub event_id: Uuid,
    pub topic: &'m str,
    pub event_type: String,
    pub partition_key: Option<String>,
    pub payload: &'m [u8],
}

/// Stores the messages (one statement; duplicates ignored) and returns how many were new.
pub(crate) async fn receive(pool: &PgPool, rows: &[InboxRow<'_>]) -> Result<u64> {
    if rows.is_empty() {
        return Ok(0);
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.event_id).collect();
    let topics: Vec<&str> = rows.iter().map(|r| r.topic).collect();
    let types: Vec<&str> = rows.iter().map(|r| r.event_type.as_str()).collect();
    let keys: Vec<Option<&str>> = rows.iter().map(|r| r.partition_key.as_deref()).collect();
    let payloads: Vec<String> = rows
        .iter()
        .map(|r| String::from_utf8_lossy(r.payload).into_owned())
        .collect();
    let result = sqlx::query(
        "INSERT INTO inbox_event (event_id, topic, event_type, partition_key, payload) \
         SELECT r.id, r.topic, r.event_type, r.partition_key, r.payload::jsonb \
         FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[]) \
             WITH ORDINALITY AS r(id, topic, event_type, partition_key, payload, n) \
         ORDER BY r.n \
         ON CONFLICT (event_id) DO NOTHING",
    )
    .bind(&ids)
    .bind(&topics)
    .bind(&types)
    .bind(&keys)
    .bind(&payloads)
    .execute(pool)
    .await?;
    Ok(result.rows_affected())
}

const CLAIM_INBOX_SQL: &str = "\
SELECT event_id, topic, event_type, payload::text AS payload, attempts FROM inbox_event \
WHERE NOT processed AND dead_at IS NULL \
  AND (next_attempt_at IS NULL OR next_attempt_at <= now()) \
ORDER BY received_at LIMIT $1 FOR UPDATE SKIP LOCKED";

/// Claims a batch of due rows and processes it in one transaction: first optimistically (every
/// handler straight in the transaction); if any fails, the batch rolls back and is processed
/// again with a savepoint per row, so a failing row undoes only its own work. Returns how many
/// rows it claimed.
pub(crate) async fn process_batch(inner: &Inner, routes: &Routes) -> Result<usize> {
    match process_batch_optimistic(inner, routes).await? {
        Ok(claimed) => Ok(claimed),
        Err(known) => process_batch_isolated(inner, routes, Some(known)).await,
    }
}

/// `Err` (nothing committed) with the row and failure if a handler failed.
async fn process_batch_optimistic(
    inner: &Inner,
    routes: &Routes,
) -> Result<std::result::Result<usize, (Uuid, Failure)>> {
    let mut tx = inner.pool.begin().await?;
    let rows = sqlx::query(CLAIM_INBOX_SQL)
        .bind(inner.batch_size as i64)
        .fetch_all(&mut *tx)
        .await?;
    let mut done: Vec<Uuid> = Vec::with_capacity(rows.len());
    for row in &rows {
        let event_id: Uuid = row.try_get("event_id")?;
        let topic: &str = row.try_get("topic")?;
        let event_type: &str = row.try_get("event_type")?;
        let payload: &str = row.try_get("payload")?;
        let span = tracing::info_span!("outbox_inbox_row", %event_id, %topic);
        for handler in routes.get(topic, event_type) {
            let result = handler
                .handle_json(payload.as_bytes(), &mut tx)
                .instrument(span.clone())
                .await;
            if let Err(failure) = result {
                tx.rollback().await?;
                return Ok(Err((event_id, failure)));
            }
        }
        done.push(event_id);
    }
    if !done.is_empty() {
        mark_processed(&mut tx, &done).await?;
    }
    tx.commit().await?;
    metrics::counter!("outbox_inbox_processed_total").increment(done.len() as u64);
    Ok(Ok(rows.len()))
}

async fn mark_processed(conn: &mut sqlx::PgConnection, done: &[Uuid]) -> Result<()> {
    sqlx::query(
        "UPDATE inbox_event SET processed = true, processed_at = now(), next_attempt_at = NULL \
         WHERE event_id = ANY($1)",
    )
    .bind(done)
    .execute(conn)
    .await?;
    Ok(())
}

async fn process_batch_isolated(
    inner: &Inner,
    routes: &Routes,
    mut known: Option<(Uuid, Failure)>,
) -> Result<usize> {
    let mut tx = inner.pool.begin().await?;
    let rows = sqlx::query(CLAIM_INBOX_SQL)
        .bind(inner.batch_size as i64)
        .fetch_all(&mut *tx)
        .await?;
    let claimed = rows.len();
    let mut done: Vec<Uuid> = Vec::with_capacity(claimed);
    let mut failed: Vec<(Uuid, String, f64, bool)> = Vec::new();
    for row in rows {
        let event_id: Uuid = row.try_get("event_id")?;
        let topic: String = row.try_get("topic")?;
        let event_type: String = row.try_get("event_type")?;
        let payload: String = row.try_get("payload")?;
        let attempts: i32 = row.try_get("attempts")?;
        let span =
            tracing::info_span!("outbox_inbox_row", %event_id, %topic, attempt = attempts + 1);
        // Its own savepoint: a failure undoes this row's work only.
        let seen = known.take_if(|(id, _)| *id == event_id).map(|(_, f)| f);
        let outcome = async {
            if let Some(failure) = seen {
                return Ok(Err(failure));
            }
            let mut savepoint = Connection::begin(&mut *tx).await?;
            for handler in routes.get(&topic, &event_type) {
                if let Err(failure) = handler
                    .handle_json(payload.as_bytes(), &mut savepoint)
                    .await
                {
                    savepoint.rollback().await?;
                    return Ok::<_, Error>(Err(failure));
                }
            }
            savepoint.commit().await?;
            Ok(Ok(()))
        }
        .instrument(span)
        .await?;
        match outcome {
            Ok(()) => done.push(event_id),
            Err(failure) => {
                let attempt = u32::try_from(attempts).unwrap_or(0) + 1;
                let dead =
                    matches!(failure, Failure::Permanent(_)) || attempt >= inner.max_attempts;
                tracing::warn!(
                    attempt,
                    dead,
                    error = failure.message(),
                    "inbox handler failed"
                );
                let backoff: Duration = inner.backoff(attempt);
                failed.push((
                    event_id,
                    failure.message().to_owned(),
                    backoff.as_secs_f64(),
                    dead,
                ));
            }
        }
    }
    if !done.is_empty() {
        mark_processed(&mut tx, &done).await?;
    }
    if !failed.is_empty() {
        let ids: Vec<Uuid> = failed.iter().map(|f| f.0).collect();
        let errors: Vec<&str> = failed.iter().map(|f| f.1.as_str()).collect();
        let backoffs: Vec<f64> = failed.iter().map(|f| f.2).collect();
        let dead: Vec<bool> = failed.iter().map(|f| f.3).collect();
        sqlx::query(
            "UPDATE inbox_event i SET attempts = i.attempts + 1, last_error = f.error, \
                 next_attempt_at = now() + make_interval(secs => f.backoff), \
                 dead_at = CASE WHEN f.dead THEN now() END \
             FROM unnest($1::uuid[], $2::text[], $3::float8[], $4::bool[]) \
                 AS f(id, error, backoff, dead) \
             WHERE i.event_id = f.id",
        )
        .bind(&ids)
        .bind(&errors)
        .bind(&backoffs)
        .bind(&dead)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    metrics::counter!("outbox_inbox_processed_total").increment(done.len() as u64);
    metrics::counter!("outbox_consumer_retried_total")
        .increment(failed.iter().filter(|f| !f.3).count() as u64);
    metrics::counter!("outbox_inbox_dead_total")
        .increment(failed.iter().filter(|f| f.3).count() as u64);
    Ok(claimed)
}

/// Inbox backlog figures.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxStatus {
    /// Rows received and not processed yet (not dead).
    pub unprocessed: i64,
    /// Of those, rows that failed and wait for a retry.
    pub retrying: i64,
    /// Dead rows (failed for good; kept).
    pub dead: i64,
    /// Age of the oldest unprocessed row (the processing lag).
    pub oldest_unprocessed_age: Option<Duration>,
    /// Rows in `processed_event` (dedup mode's ledger).
    pub processed_event_rows: i64,
}

/// Inbox backlog figures, from the database alone.
pub async fn inbox_status(pool: &PgPool) -> Result<InboxStatus> {
    let row = sqlx::query(
        "SELECT count(*) FILTER (WHERE dead_at IS NULL) AS unprocessed, \
                count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at IS NOT NULL) AS retrying, \
                count(*) FILTER (WHERE dead_at IS NOT NULL) AS dead, \
                extract(epoch FROM now() - min(received_at) FILTER (WHERE dead_at IS NULL))::float8 AS age, \
                (SELECT count(*) FROM processed_event) AS processed_event_rows \
         FROM inbox_event WHERE NOT processed",
    )
    .fetch_one(pool)
    .await?;
    let age: Option<f64> = row.try_get("age")?;
    Ok(InboxStatus {
        unprocessed: row.try_get("unprocessed")?,
        retrying: row.try_get("retrying")?,
        dead: row.try_get("dead")?,
        oldest_unprocessed_age: age.map(|s| Duration::from_secs_f64(s.max(0.0))),
        processed_event_rows: row.try_get("processed_event_rows")?,
    })
}
