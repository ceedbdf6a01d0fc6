//! The unit of work: domain writes and outbox rows in one database transaction (PostgreSQL, or
//! MariaDB/MySQL with the `mysql` feature: [`EmitDatabase`]).
//!
//! Nothing here can reach a Kafka producer (rule R-DIST-OBX-X1): emitting only inserts rows;
//! publishing is the relay's job.

mod commit;
mod database;
mod insert;

use std::borrow::Cow;
use std::ops::{Deref, DerefMut};

use sqlx::{Database, Pool, Postgres, Transaction};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::event::{IntoRecord, OutboxEvent, OutboxRecord};

#[cfg(feature = "_broker")]
pub(crate) use commit::commit_checked;
#[cfg(feature = "mysql")]
pub(crate) use database::is_outermost;
pub use database::EmitDatabase;
#[cfg(feature = "mysql")]
pub(crate) use insert::event_types;
pub(crate) use insert::into_records;
pub use insert::{emit, emit_all, emit_with, EmitFuture};

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
///
/// # MariaDB and MySQL
///
/// With the `mysql` feature, `Uow::begin(&mysql_pool)` is a `Uow<'_, MySql>` and reads the same:
/// the rows are written at `commit` (or `flush`), with the key locks, in the same round trip as
/// `COMMIT`, and every write and commit checks that the server still has the transaction open: InnoDB rolls a deadlocked
/// transaction back whole and lets the session go on outside it, so a unit of work whose error
/// was caught and ignored fails with [`Error::NotInTransaction`] instead of reporting the
/// statements that ran alone after it as committed. See [`crate::mysql`].
#[must_use = "a unit of work rolls back when dropped; call `commit`"]
pub struct Uow<'c, DB: Database = Postgres> {
    /// `None` once `commit`, `rollback` or `into_inner` took it.
    tx: Option<Transaction<'c, DB>>,
    /// Emitted rows not written yet, in emission order.
    pending: Vec<OutboxRecord>,
    pending_bytes: usize,
    emitted: usize,
    failed: Option<String>,
}

impl<DB: EmitDatabase> Uow<'static, DB> {
    /// Begins a transaction on a connection from the pool.
    pub async fn begin(pool: &Pool<DB>) -> Result<Self> {
        Ok(Self::from_transaction(pool.begin().await?))
    }

    /// Begins a transaction with a `BEGIN` statement of the application's choice, e.g.
    /// `"BEGIN ISOLATION LEVEL SERIALIZABLE"`.
    pub async fn begin_with(
        pool: &Pool<DB>,
        statement: impl Into<Cow<'static, str>>,
    ) -> Result<Self> {
        Ok(Self::from_transaction(pool.begin_with(statement).await?))
    }
}

impl<'c, DB: EmitDatabase> Uow<'c, DB> {
    /// Wraps a transaction (or savepoint) the application already began. The commit of an
    /// outermost transaction writes the pending rows and commits in one round trip; a savepoint
    /// writes them with one statement and is released into its transaction.
    pub fn from_transaction(tx: Transaction<'c, DB>) -> Self {
        Uow {
            tx: Some(tx),
            pending: Vec::new(),
            pending_bytes: 0,
            emitted: 0,
            failed: None,
        }
    }

    /// The transaction's connection, for the domain statements: `query.execute(uow.tx())`.
    pub fn tx(&mut self) -> &mut DB::Connection {
        self.as_transaction_mut()
    }

    /// The transaction, for code that takes `&mut Transaction<'_, Postgres>`. Events emitted
    /// and not flushed yet are not in it: see [`flush`](Self::flush).
    pub fn as_transaction_mut(&mut self) -> &mut Transaction<'c, DB> {
        // Only `commit`, `rollback` and `into_inner` take the transaction, and they consume the
        // unit of work: no method can see it gone.
        self.tx.as_mut().expect("the unit of work has ended")
    }

    /// Writes the pending rows and returns the transaction, for an application that commits it
    /// itself. Fails (and rolls back) if an emit failed earlier.
    pub async fn into_inner(mut self) -> Result<Transaction<'c, DB>> {
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
        let result = DB::write(tx, &self.pending).await;
        self.pending.clear();
        self.pending_bytes = 0;
        self.record_failure(result).map(drop)
    }

    async fn keep(&mut self, records: Result<Vec<OutboxRecord>>) -> Result<Vec<Uuid>> {
        self.check_not_failed()?;
        let records = records.and_then(|records| {
            records.iter().try_for_each(DB::check)?;
            Ok(records)
        });
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
        let tx = self.tx.take().expect("the unit of work has ended");
        DB::commit(tx, std::mem::take(&mut self.pending)).await
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

impl<DB: EmitDatabase> Deref for Uow<'_, DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        self.tx.as_ref().expect("the unit of work has ended")
    }
}

impl<DB: EmitDatabase> DerefMut for Uow<'_, DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.tx()
    }
}

impl<DB: Database> std::fmt::Debug for Uow<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uow")
            .field("emitted", &self.emitted)
            .field("pending", &self.pending.len())
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}
