//! The unit of work: domain writes and outbox rows in one PostgreSQL transaction.
//!
//! Nothing here can reach a Kafka producer (rule R-DIST-OBX-X1): emitting only inserts rows;
//! publishing is the relay's job.

use std::borrow::Cow;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;

use sqlx::{Database, Executor, PgConnection, PgPool, Postgres, Transaction, TransactionManager};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::event::{IntoRecord, OutboxEvent, OutboxRecord};
use crate::sqlstate::DbError;

/// One call for any number of rows. `outbox_emit` (`migrations/README.md` says which file
/// holds its current definition) takes a transaction-scoped advisory lock on the hash of each
/// partition key, so that one key's rows commit in `id` order (the relay's per-key ordering
/// relies on it), inserts the rows in the order given, and wakes waiting relays.
const EMIT_SQL: &str = "SELECT outbox_emit($1::uuid[], $2::text[], $3::text[], $4::text[], \
                        $5::text[], $6::text[], $7::text[])";
/// The same with the rows' headers, when one of them has any (emits without headers keep the
/// statement above, and its cost).
const EMIT_WITH_HEADERS_SQL: &str = "SELECT outbox_emit($1::uuid[], $2::text[], $3::text[], \
                                     $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])";

/// Buffered events are written early (one statement, one round trip) past this many...
const FLUSH_AT_EVENTS: usize = 10_000;
/// ...or this many bytes of payload, so that a huge unit of work does not hold them all.
const FLUSH_AT_BYTES: usize = 8 << 20;

/// A database transaction that can emit outbox events.
///
/// Commit writes the domain rows and the outbox rows together; dropping it without
/// [`commit`](Self::commit) rolls everything back.
///
/// ```no_run
/// # use outbox_runtime::{OutboxEvent, Uow};
/// # #[derive(serde::Serialize, OutboxEvent)]
/// # #[outbox(topic = "order.events", aggregate_type = "Order")]
/// # struct OrderCreated { #[outbox(aggregate_id)] order_id: uuid::Uuid }
/// # async fn f(pool: sqlx::PgPool, order_id: uuid::Uuid) -> Result<(), Box<dyn std::error::Error>> {
/// let mut uow = Uow::begin(&pool).await?;
/// sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind(order_id).execute(uow.tx()).await?;
/// uow.emit(&OrderCreated { order_id }).await?;
/// uow.commit().await?;
/// # Ok(()) }
/// ```
///
/// # A real sqlx transaction
///
/// The unit of work is an [`sqlx::Transaction`]: code that takes the connection
/// ([`tx`](Self::tx)) and opens a transaction of its own (`conn.begin()`) gets a savepoint, whose
/// `commit` releases it into the unit of work and whose rollback undoes only its own work. Code
/// that needs the transaction itself gets it from
/// [`as_transaction_mut`](Self::as_transaction_mut), or, with the events written into it, from
/// [`into_inner`](Self::into_inner).
///
/// # When the rows are written
///
/// `emit` validates the event, serializes its payload and keeps the row; it does no I/O.
/// [`commit`](Self::commit) of an outermost transaction writes the kept rows and commits in
/// **one round trip**, so an emit costs the transaction no extra round trip.
/// [`flush`](Self::flush) writes them earlier, with one statement, for an application that
/// wants to read them back in the transaction or see a database error before commit. A very
/// large unit of work flushes on its own every 10,000 events or 8 MiB of payload.
///
/// # Errors never half-write
///
/// An invalid event, a payload that does not serialize, or a database error names the event
/// type. After any failed emit or flush the unit of work is spoiled: later emits and
/// [`commit`](Self::commit) fail with [`Error::EmitFailedEarlier`] and it rolls back, so a domain
/// change is never committed without its event. A transaction that PostgreSQL aborted because a
/// statement failed (an error the application caught and went on from) is never reported as
/// committed: `commit` fails with [`Error::Aborted`]. If the connection fails after `COMMIT` was
/// sent, nobody can know whether it committed: [`Error::CommitOutcomeUnknown`].
///
/// # Deadlocks
///
/// Writing a key's event takes a transaction-scoped lock on that key, so that one key's events
/// commit in the order of their outbox ids. A unit of work that writes all its events at
/// `commit` takes all its keys' locks at once, in a fixed order: such units of work never
/// deadlock on them. One that writes events in several statements ([`flush`](Self::flush), the
/// automatic flush of a very large unit of work, or several [`emit`](crate::emit) calls on an
/// application-managed transaction) takes them in several steps, and two of those with common
/// keys in opposite orders can deadlock: PostgreSQL then aborts one of them with
/// `deadlock_detected`, an error for which [`Error::is_transient`] is true. Retry it.
#[must_use = "a unit of work rolls back when dropped; call `commit`"]
pub struct Uow<'c> {
    /// `None` once `commit`, `rollback` or `into_inner` took it.
    tx: Option<Transaction<'c, Postgres>>,
    /// Emitted rows not written yet, in emission order.
    pending: Vec<OutboxRecord>,
    pending_bytes: usize,
    emitted: usize,
    failed: Option<String>,
}

impl Uow<'static> {
    /// Begins a transaction on a connection from the pool.
    pub async fn begin(pool: &PgPool) -> Result<Self> {
        Ok(Self::from_transaction(pool.begin().await?))
    }

    /// Begins a transaction with a `BEGIN` statement of the application's choice, e.g.
    /// `"BEGIN ISOLATION LEVEL SERIALIZABLE"`.
    pub async fn begin_with(
        pool: &PgPool,
        statement: impl Into<Cow<'static, str>>,
    ) -> Result<Self> {
        Ok(Self::from_transaction(pool.begin_with(statement).await?))
    }
}

impl<'c> Uow<'c> {
    /// Wraps a transaction (or savepoint) the application already began. The commit of an
    /// outermost transaction writes the pending rows and commits in one round trip; a savepoint
    /// writes them with one statement and is released into its transaction.
    pub fn from_transaction(tx: Transaction<'c, Postgres>) -> Self {
        Uow {
            tx: Some(tx),
            pending: Vec::new(),
            pending_bytes: 0,
            emitted: 0,
            failed: None,
        }
    }

    /// The transaction's connection, for the domain statements: `query.execute(uow.tx())`.
    pub fn tx(&mut self) -> &mut PgConnection {
        self.as_transaction_mut()
    }

    /// The transaction, for code that takes `&mut Transaction<'_, Postgres>`. Events emitted
    /// and not flushed yet are not in it: see [`flush`](Self::flush).
    pub fn as_transaction_mut(&mut self) -> &mut Transaction<'c, Postgres> {
        // Only `commit`, `rollback` and `into_inner` take the transaction, and they consume the
        // unit of work: no method can see it gone.
        self.tx.as_mut().expect("the unit of work has ended")
    }

    /// Writes the pending rows and returns the transaction, for an application that commits it
    /// itself. Fails (and rolls back) if an emit failed earlier.
    pub async fn into_inner(mut self) -> Result<Transaction<'c, Postgres>> {
        self.flush().await?;
        Ok(self.tx.take().expect("the unit of work has ended"))
    }

    /// Adds the event to this transaction's outbox rows and returns its event id.
    ///
    /// The event is validated and serialized at once; the returned future borrows nothing from
    /// it. See [When the rows are written](Self#when-the-rows-are-written).
    pub fn emit<E: OutboxEvent + ?Sized>(&mut self, event: &E) -> EmitFuture<'_, Uuid> {
        let record = OutboxRecord::from_event(event).map(|r| vec![r]);
        Box::pin(async move { Ok(self.keep(record).await?[0]) })
    }

    /// [`emit`](Self::emit) with the application's headers (a tenant, a correlation id, ...):
    /// stored with the row, sent as Kafka headers after the framework's own. See
    /// [`OutboxRecord::with_headers`] for the names refused.
    ///
    /// ```no_run
    /// # use outbox_runtime::{OutboxEvent, Uow};
    /// # #[derive(serde::Serialize, OutboxEvent)]
    /// # #[outbox(topic = "order.events", aggregate_type = "Order")]
    /// # struct OrderCreated { #[outbox(aggregate_id)] order_id: uuid::Uuid }
    /// # async fn f(uow: &mut Uow<'_>, event: OrderCreated) -> outbox_runtime::Result<()> {
    /// uow.emit_with(&event, [("tenant", "acme"), ("correlation_id", "req-42")]).await?;
    /// # Ok(()) }
    /// ```
    pub fn emit_with<E, I, K, V>(&mut self, event: &E, headers: I) -> EmitFuture<'_, Uuid>
    where
        E: OutboxEvent + ?Sized,
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let record = OutboxRecord::from_event(event)
            .and_then(|r| r.with_headers(headers))
            .map(|r| vec![r]);
        Box::pin(async move { Ok(self.keep(record).await?[0]) })
    }

    /// Adds many events, in order, and returns their event ids. They are written with the
    /// others in one statement. Takes `&E` for any event type, or [`OutboxRecord`]s to mix types.
    pub fn emit_all<I>(&mut self, events: I) -> EmitFuture<'_, Vec<Uuid>>
    where
        I: IntoIterator,
        I::Item: IntoRecord,
    {
        let records = into_records(events);
        Box::pin(self.keep(records))
    }

    /// Writes the pending rows now, with one statement (one round trip).
    pub async fn flush(&mut self) -> Result<()> {
        self.check_not_failed()?;
        if self.pending.is_empty() {
            return Ok(());
        }
        let tx = self.tx.as_mut().expect("the unit of work has ended");
        let result = insert(tx, &self.pending).await;
        self.pending.clear();
        self.pending_bytes = 0;
        self.record_failure(result).map(drop)
    }

    async fn keep(&mut self, records: Result<Vec<OutboxRecord>>) -> Result<Vec<Uuid>> {
        self.check_not_failed()?;
        let records = self.record_failure(records)?;
        let ids: Vec<Uuid> = records.iter().map(OutboxRecord::event_id).collect();
        self.pending_bytes += records.iter().map(|r| r.payload.len()).sum::<usize>();
        self.pending.extend(records);
        self.emitted += ids.len();
        if self.pending.len() >= FLUSH_AT_EVENTS || self.pending_bytes >= FLUSH_AT_BYTES {
            self.flush().await?;
        }
        Ok(ids)
    }

    fn check_not_failed(&self) -> Result<()> {
        match &self.failed {
            Some(first_error) => Err(Error::EmitFailedEarlier {
                first_error: first_error.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Spoils the unit of work if `result` is an error.
    fn record_failure<T>(&mut self, result: Result<T>) -> Result<T> {
        if let Err(e) = &result {
            self.failed
                .get_or_insert_with(|| crate::error_chain(e).to_string());
        }
        result
    }

    /// How many events this unit of work has emitted so far (written or pending).
    pub fn emitted(&self) -> usize {
        self.emitted
    }

    /// Writes the pending rows and commits them with the domain rows.
    ///
    /// Fails, and writes nothing, if an emit failed earlier ([`Error::EmitFailedEarlier`]), if
    /// a statement failed and left the transaction aborted ([`Error::Aborted`]), or if the
    /// database refused the rows or the commit ([`Error::Commit`]). If the connection fails
    /// after `COMMIT` was sent, the transaction may or may not have committed:
    /// [`Error::CommitOutcomeUnknown`].
    pub async fn commit(mut self) -> Result<()> {
        if let Some(first_error) = self.failed.take() {
            self.rollback_now().await?;
            return Err(Error::EmitFailedEarlier { first_error });
        }
        let event_types = event_types(&self.pending);
        let tx = self.as_transaction_mut();
        if <Postgres as Database>::TransactionManager::get_transaction_depth(tx) != 1 {
            // A savepoint: release it into the transaction that holds it.
            self.flush().await?;
            let tx = self.tx.take().expect("the unit of work has ended");
            return tx.commit().await.map_err(|e| commit_error(e, event_types));
        }
        // One simple query: the rows, COMMIT, and BEGIN of an empty transaction that the
        // dropped `Transaction` then rolls back (pipelined with the connection's next use), so
        // that sqlx's transaction depth and the server agree again without a round trip.
        // Without rows, `SELECT` stands in for them: in an aborted transaction it fails, where
        // a bare COMMIT would "succeed" with a rollback. On an error the server skips the rest
        // of the query, and the dropped transaction rolls back.
        let sql = if self.pending.is_empty() {
            String::from("SELECT")
        } else {
            literal_emit(&self.pending)?
        };
        let tx = self.tx.take().expect("the unit of work has ended");
        commit_after(tx, sql, event_types).await
    }

    /// Rolls back everything done in this unit of work.
    pub async fn rollback(mut self) -> Result<()> {
        self.rollback_now().await
    }

    async fn rollback_now(&mut self) -> Result<()> {
        if let Some(tx) = self.tx.take() {
            tx.rollback().await?;
        }
        Ok(())
    }
}

/// Commits a transaction this crate began (at depth 1), checked as [`Uow::commit`] does: an
/// aborted transaction is [`Error::Aborted`], a refused commit [`Error::Commit`], a session lost
/// on the way [`Error::CommitOutcomeUnknown`].
#[cfg(feature = "kafka")]
pub(crate) async fn commit_checked(tx: Transaction<'_, Postgres>) -> Result<()> {
    commit_after(tx, String::from("SELECT"), Cow::Borrowed("")).await
}

/// Sends `sql` (whose failure in an aborted transaction is the point), `COMMIT`, and `BEGIN` of
/// an empty transaction that the dropped `Transaction` rolls back with the connection's next
/// use (so sqlx's depth and the server agree again without a round trip), as one simple query;
/// judges the outcome by the statements that completed.
async fn commit_after(
    mut tx: Transaction<'_, Postgres>,
    mut sql: String,
    event_types: Cow<'static, str>,
) -> Result<()> {
    sql.push_str("; COMMIT; BEGIN");
    match run_counting(&mut tx, &sql).await {
        Ok(_) => Ok(()),
        // COMMIT completed; what failed came after it (the server going away, say).
        Err((completed, _)) if completed >= 2 => Ok(()),
        Err((_, e)) => {
            let error = commit_error(e, event_types);
            if !error.is_outcome_unknown() {
                // Release its locks now, not when the connection is next used.
                if let Err(e) = tx.rollback().await {
                    tracing::debug!(error = %crate::error_chain(&e), "cannot roll back a failed transaction");
                }
            }
            Err(error)
        }
    }
}

/// Runs a simple query of several statements; on an error, also says how many statements had
/// completed before it.
async fn run_counting(
    conn: &mut PgConnection,
    sql: &str,
) -> std::result::Result<u64, (u64, sqlx::Error)> {
    let mut results = conn.fetch_many(sql);
    let mut completed = 0;
    loop {
        match std::future::poll_fn(|cx| results.as_mut().poll_next(cx)).await {
            None => return Ok(completed),
            Some(Ok(sqlx::Either::Left(_))) => completed += 1,
            Some(Ok(sqlx::Either::Right(_))) => {}
            Some(Err(e)) => return Err((completed, e)),
        }
    }
}

/// What a failed commit means: refused (nothing written), aborted earlier, or unknown.
fn commit_error(source: sqlx::Error, event_types: Cow<'static, str>) -> Error {
    match &source {
        _ if DbError::of(&source) == DbError::Aborted => Error::Aborted { event_types },
        // A statement failed: the server skipped the rest, COMMIT included.
        sqlx::Error::Database(e) if !is_fatal(e.as_ref()) => Error::Commit {
            event_types,
            source,
        },
        // The session ended (the server shutting down, the connection lost) while COMMIT was
        // on its way: it may have committed before.
        _ => Error::CommitOutcomeUnknown {
            event_types,
            source,
        },
    }
}

/// Whether the server ended the session with this error (FATAL or PANIC), rather than failing
/// one statement.
fn is_fatal(error: &dyn sqlx::error::DatabaseError) -> bool {
    use sqlx::postgres::{PgDatabaseError, PgSeverity};
    error
        .try_downcast_ref::<PgDatabaseError>()
        .is_some_and(|e| matches!(e.severity(), PgSeverity::Fatal | PgSeverity::Panic))
}

impl Deref for Uow<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.tx.as_ref().expect("the unit of work has ended")
    }
}

impl DerefMut for Uow<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.tx()
    }
}

impl std::fmt::Debug for Uow<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uow")
            .field("emitted", &self.emitted)
            .field("pending", &self.pending.len())
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

/// Inserts one event into the outbox on a connection the application manages, e.g.
/// `emit(&mut tx, &event)` with `tx: sqlx::Transaction<'_, Postgres>`.
///
/// The row commits with that connection's transaction. On a connection outside a transaction it
/// commits at once, alone: use a [`Uow`] or a transaction to keep it atomic with domain writes.
pub fn emit<'c, E: OutboxEvent + ?Sized>(
    conn: &'c mut PgConnection,
    event: &E,
) -> EmitFuture<'c, Uuid> {
    let record = OutboxRecord::from_event(event);
    Box::pin(async move { Ok(insert(conn, &[record?]).await?[0]) })
}

/// [`emit`] with the application's headers; see [`Uow::emit_with`].
pub fn emit_with<'c, E, I, K, V>(
    conn: &'c mut PgConnection,
    event: &E,
    headers: I,
) -> EmitFuture<'c, Uuid>
where
    E: OutboxEvent + ?Sized,
    I: IntoIterator<Item = (K, V)>,
    K: Into<String>,
    V: Into<String>,
{
    let record = OutboxRecord::from_event(event).and_then(|r| r.with_headers(headers));
    Box::pin(async move { Ok(insert(conn, &[record?]).await?[0]) })
}

/// Inserts many events with one statement on a connection the application manages; see [`emit`].
pub fn emit_all<I>(conn: &mut PgConnection, events: I) -> EmitFuture<'_, Vec<Uuid>>
where
    I: IntoIterator,
    I::Item: IntoRecord,
{
    let records = into_records(events);
    Box::pin(async move { insert(conn, &records?).await })
}

/// What the emit functions return: the insert, still to be awaited.
pub type EmitFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

fn into_records<I>(events: I) -> Result<Vec<OutboxRecord>>
where
    I: IntoIterator,
    I::Item: IntoRecord,
{
    events.into_iter().map(IntoRecord::into_record).collect()
}

/// The event type(s) of a batch, for error messages.
fn event_types(records: &[OutboxRecord]) -> Cow<'static, str> {
    if records.is_empty() {
        return Cow::Borrowed("");
    }
    let mut types: Vec<&str> = records.iter().map(|r| r.event_type()).collect();
    types.sort_unstable();
    types.dedup();
    match records.first() {
        Some(first) if types.len() == 1 => first.event_type.clone(),
        _ => types.join("`, `").into(),
    }
}

async fn insert(conn: &mut PgConnection, records: &[OutboxRecord]) -> Result<Vec<Uuid>> {
    if records.is_empty() {
        return Ok(Vec::new());
    }
    let n = records.len();
    let mut ids = Vec::with_capacity(n);
    let mut aggregate_types = Vec::with_capacity(n);
    let mut aggregate_ids = Vec::with_capacity(n);
    let mut event_types_col = Vec::with_capacity(n);
    let mut payloads = Vec::with_capacity(n);
    let mut topics = Vec::with_capacity(n);
    let mut keys = Vec::with_capacity(n);
    for r in records {
        ids.push(r.event_id);
        aggregate_types.push(r.aggregate_type());
        aggregate_ids.push(r.aggregate_id());
        event_types_col.push(r.event_type());
        payloads.push(r.payload());
        topics.push(r.topic());
        keys.push(r.partition_key());
    }
    let with_headers = records.iter().any(OutboxRecord::has_stored_headers);
    let headers: Vec<String> = if with_headers {
        records.iter().map(OutboxRecord::headers_json).collect()
    } else {
        Vec::new()
    };
    let query = sqlx::query(if with_headers {
        EMIT_WITH_HEADERS_SQL
    } else {
        EMIT_SQL
    })
    .bind(&ids)
    .bind(&aggregate_types)
    .bind(&aggregate_ids)
    .bind(&event_types_col)
    .bind(&payloads)
    .bind(&topics)
    .bind(&keys);
    let query = if with_headers {
        query.bind(&headers)
    } else {
        query
    };
    query.execute(conn).await.map_err(|source| Error::Emit {
        event_type: event_types(records),
        source,
    })?;
    Ok(ids)
}

/// `SELECT outbox_emit(ARRAY[...], ...)` with every value as a literal, for the
/// one-round-trip commit (a simple query carries no parameters).
///
/// Strings are written as `E'...'` literals with every backslash and quote escaped, which is
/// exact whatever `standard_conforming_strings` says; sqlx always talks UTF-8; a NUL character,
/// which no PostgreSQL text can hold, is refused before anything is sent.
fn literal_emit(records: &[OutboxRecord]) -> Result<String> {
    let size: usize = records.iter().map(|r| r.payload.len() + 250).sum();
    let mut sql = String::with_capacity(size + 128);
    sql.push_str("SELECT outbox_emit(ARRAY[");
    let mut buf = Uuid::encode_buffer();
    for (i, r) in records.iter().enumerate() {
        if i > 0 {
            sql.push_str(", ");
        }
        sql.push('\'');
        sql.push_str(r.event_id.hyphenated().encode_lower(&mut buf));
        sql.push('\'');
    }
    sql.push_str("]::uuid[]");
    let columns: [fn(&OutboxRecord) -> &str; 6] = [
        OutboxRecord::aggregate_type,
        OutboxRecord::aggregate_id,
        OutboxRecord::event_type,
        OutboxRecord::payload,
        OutboxRecord::topic,
        OutboxRecord::partition_key,
    ];
    for column in columns {
        sql.push_str(", ARRAY[");
        for (i, r) in records.iter().enumerate() {
            if i > 0 {
                sql.push_str(", ");
            }
            push_literal(&mut sql, column(r)).map_err(|()| nul_error(r))?;
        }
        sql.push_str("]::text[]");
    }
    // The headers, only when a row has some (else the 7-argument `outbox_emit`).
    if records.iter().any(OutboxRecord::has_stored_headers) {
        sql.push_str(", ARRAY[");
        for (i, r) in records.iter().enumerate() {
            if i > 0 {
                sql.push_str(", ");
            }
            push_literal(&mut sql, &r.headers_json()).map_err(|()| nul_error(r))?;
        }
        sql.push_str("]::text[]");
    }
    sql.push(')');
    Ok(sql)
}

fn nul_error(r: &OutboxRecord) -> Error {
    Error::InvalidEvent {
        event_type: r.event_type.clone(),
        reason: "contains a NUL character, which PostgreSQL text cannot store".into(),
    }
}

fn push_literal(sql: &mut String, value: &str) -> Result<(), ()> {
    sql.push_str("E'");
    for c in value.chars() {
        match c {
            '\'' => sql.push_str("''"),
            '\\' => sql.push_str("\\\\"),
            '\0' => return Err(()),
            c => sql.push(c),
        }
    }
    sql.push('\'');
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::push_literal;

    fn literal(value: &str) -> String {
        let mut sql = String::new();
        push_literal(&mut sql, value).unwrap();
        sql
    }

    #[test]
    fn literals_escape_quotes_and_backslashes() {
        assert_eq!(literal("plain"), "E'plain'");
        assert_eq!(literal("it's"), "E'it''s'");
        assert_eq!(literal(r"a\b"), r"E'a\\b'");
        assert_eq!(
            literal(r"\'); DROP TABLE x; --"),
            r"E'\\''); DROP TABLE x; --'"
        );
        assert_eq!(literal("ключ ✓"), "E'ключ ✓'");
        assert!(push_literal(&mut String::new(), "a\0b").is_err());
    }
}
