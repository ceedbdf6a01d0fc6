//! The unit of work: domain writes and outbox rows in one PostgreSQL transaction.
//!
//! Nothing here can reach a Kafka producer (rule R-DIST-OBX-X1): emitting only inserts rows;
//! publishing is the relay's job.

use std::borrow::Cow;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;

use sqlx::pool::PoolConnection;
use sqlx::{Executor, PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::event::{IntoRecord, OutboxEvent, OutboxRecord};

/// One call for any number of rows. `outbox_emit` (see the relay migration) takes a
/// transaction-scoped advisory lock on the hash of each partition key, so that one key's rows
/// commit in `id` order (the relay's per-key ordering relies on it), inserts the rows in the
/// order given, and wakes waiting relays.
const EMIT_SQL: &str = "SELECT outbox_emit($1::uuid[], $2::text[], $3::text[], $4::text[], \
                        $5::text[], $6::text[], $7::text[])";

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
/// # When the rows are written
///
/// `emit` validates the event, serializes its payload and keeps the row; it does no I/O.
/// [`commit`](Self::commit) writes the kept rows and commits in **one round trip** (a unit of
/// work begun with [`Uow::begin`]), so an emit costs the transaction no extra round trip.
/// [`flush`](Self::flush) writes them earlier, with one statement, for an application that
/// wants to read them back in the transaction or see a database error before commit. A very
/// large unit of work flushes on its own every 10,000 events or 8 MiB of payload.
///
/// # Errors never half-write
///
/// An invalid event, a payload that does not serialize, or a database error names the event
/// type. After any failed emit or flush the unit of work is spoiled: later emits and
/// [`commit`](Self::commit) fail with [`Error::EmitFailedEarlier`] and it rolls back, so a domain
/// change is never committed without its event.
#[must_use = "a unit of work rolls back when dropped; call `commit`"]
pub struct Uow<'c> {
    conn: Conn<'c>,
    /// Emitted rows not written yet, in emission order.
    pending: Vec<OutboxRecord>,
    pending_bytes: usize,
    emitted: usize,
    failed: Option<String>,
}

enum Conn<'c> {
    /// A pooled connection in a transaction this unit of work began and ends itself, so that
    /// `commit` can send the pending rows and `COMMIT` in one simple query. `None` once the
    /// transaction has ended.
    Owned(Option<PoolConnection<Postgres>>),
    /// A transaction or savepoint the application began.
    Borrowed(Transaction<'c, Postgres>),
}

impl Uow<'static> {
    /// Begins a transaction on a connection from the pool.
    pub async fn begin(pool: &PgPool) -> Result<Self> {
        let mut conn = pool.acquire().await?;
        conn.execute("BEGIN").await?;
        Ok(Self::new(Conn::Owned(Some(conn))))
    }
}

impl<'c> Uow<'c> {
    /// Wraps a transaction (or savepoint) the application already began. Its commit writes the
    /// pending rows with one statement, then commits the transaction as sqlx does.
    pub fn from_transaction(tx: Transaction<'c, Postgres>) -> Self {
        Self::new(Conn::Borrowed(tx))
    }

    fn new(conn: Conn<'c>) -> Self {
        Uow {
            conn,
            pending: Vec::new(),
            pending_bytes: 0,
            emitted: 0,
            failed: None,
        }
    }

    /// The transaction's connection, for the domain statements: `query.execute(uow.tx())`.
    pub fn tx(&mut self) -> &mut PgConnection {
        self.conn.get()
    }

    /// Adds the event to this transaction's outbox rows and returns its event id.
    ///
    /// The event is validated and serialized at once; the returned future borrows nothing from
    /// it. See [When the rows are written](Self#when-the-rows-are-written).
    pub fn emit<E: OutboxEvent + ?Sized>(&mut self, event: &E) -> EmitFuture<'_, Uuid> {
        let record = OutboxRecord::from_event(event).map(|r| vec![r]);
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
        let result = insert(self.conn.get(), &self.pending).await;
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
            self.failed.get_or_insert_with(|| e.to_string());
        }
        result
    }

    /// How many events this unit of work has emitted so far (written or pending).
    pub fn emitted(&self) -> usize {
        self.emitted
    }

    /// Writes the pending rows and commits them with the domain rows.
    ///
    /// If an emit failed earlier, rolls back instead and returns [`Error::EmitFailedEarlier`].
    /// If the commit fails, nothing of the unit of work is written.
    pub async fn commit(mut self) -> Result<()> {
        if let Some(first_error) = self.failed.take() {
            self.end("ROLLBACK").await?;
            return Err(Error::EmitFailedEarlier { first_error });
        }
        if let Conn::Borrowed(_) = self.conn {
            self.flush().await?;
            let Conn::Borrowed(tx) = self.take_conn() else {
                unreachable!()
            };
            tx.commit().await?;
            return Ok(());
        }
        if self.pending.is_empty() {
            return self.end("COMMIT").await;
        }
        // One simple query: the rows, then COMMIT. On an error the server skips the rest and
        // nothing commits; the transaction is then rolled back like any dropped one.
        let mut sql = literal_emit(&self.pending)?;
        sql.push_str("; COMMIT");
        let result = self.tx().execute(sql.as_str()).await;
        match result {
            Ok(_) => {
                self.take_conn();
                Ok(())
            }
            Err(source) => Err(Error::Commit {
                event_types: event_types(&self.pending),
                source,
            }),
        }
    }

    /// Rolls back everything done in this unit of work.
    pub async fn rollback(mut self) -> Result<()> {
        self.end("ROLLBACK").await
    }

    /// Ends the transaction with `COMMIT` or `ROLLBACK`.
    async fn end(&mut self, statement: &'static str) -> Result<()> {
        match self.take_conn() {
            Conn::Owned(Some(mut conn)) => {
                conn.execute(statement).await?;
            }
            Conn::Owned(None) => {}
            Conn::Borrowed(tx) if statement == "COMMIT" => tx.commit().await?,
            Conn::Borrowed(tx) => tx.rollback().await?,
        }
        Ok(())
    }

    /// Takes the connection out, leaving the unit of work ended (its drop then does nothing).
    fn take_conn(&mut self) -> Conn<'c> {
        std::mem::replace(&mut self.conn, Conn::Owned(None))
    }
}

impl Conn<'_> {
    fn get(&mut self) -> &mut PgConnection {
        match self {
            // Only `commit`, `rollback` and `drop` end the transaction, and they consume the
            // unit of work: no method can see it ended.
            Conn::Owned(conn) => conn.as_mut().expect("the unit of work has ended"),
            Conn::Borrowed(tx) => tx,
        }
    }
}

impl Drop for Uow<'_> {
    /// Rolls back a transaction that was neither committed nor rolled back: a `Borrowed` one as
    /// sqlx does; an `Owned` one on a task that then returns the connection to the pool, or, with
    /// no runtime to run it, by closing the connection (the server rolls back).
    fn drop(&mut self) {
        if let Conn::Owned(Some(mut conn)) = self.take_conn() {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(async move {
                        if conn.execute("ROLLBACK").await.is_err() {
                            conn.close_on_drop();
                        }
                    });
                }
                Err(_) => conn.close_on_drop(),
            }
        }
    }
}

impl Deref for Uow<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match &self.conn {
            Conn::Owned(conn) => conn.as_ref().expect("the unit of work has ended"),
            Conn::Borrowed(tx) => tx,
        }
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
    sqlx::query(EMIT_SQL)
        .bind(&ids)
        .bind(&aggregate_types)
        .bind(&aggregate_ids)
        .bind(&event_types_col)
        .bind(&payloads)
        .bind(&topics)
        .bind(&keys)
        .execute(conn)
        .await
        .map_err(|source| Error::Emit {
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
