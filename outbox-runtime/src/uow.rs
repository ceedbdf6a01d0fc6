//! The unit of work: domain writes and outbox rows in one PostgreSQL transaction.
//!
//! Nothing here can reach a Kafka producer (rule R-DIST-OBX-X1): emitting only inserts rows;
//! publishing is the relay's job.

use std::borrow::Cow;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;

use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::event::{IntoRecord, OutboxEvent, OutboxRecord};

/// One statement for any number of rows: seven arrays unnested in order, so `id`s follow the
/// order of emission.
const INSERT_SQL: &str = "\
INSERT INTO outbox_event \
    (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key) \
SELECT r.event_id, r.aggregate_type, r.aggregate_id, r.event_type, r.payload::jsonb, r.topic, r.partition_key \
FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[]) \
    WITH ORDINALITY AS r(event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key, n) \
ORDER BY r.n";

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
/// After a failed emit the unit of work is spoiled: [`commit`](Self::commit) rolls back and
/// returns [`Error::EmitFailedEarlier`], so a domain change is never committed without its event.
#[must_use = "a unit of work rolls back when dropped; call `commit`"]
pub struct Uow<'c> {
    tx: Transaction<'c, Postgres>,
    emitted: usize,
    failed: Option<String>,
}

impl Uow<'static> {
    /// Begins a transaction on a connection from the pool.
    pub async fn begin(pool: &PgPool) -> Result<Self> {
        Ok(Self::from_transaction(pool.begin().await?))
    }
}

impl<'c> Uow<'c> {
    /// Wraps a transaction the application already began.
    pub fn from_transaction(tx: Transaction<'c, Postgres>) -> Self {
        Uow {
            tx,
            emitted: 0,
            failed: None,
        }
    }

    /// The transaction's connection, for the domain statements: `query.execute(uow.tx())`.
    pub fn tx(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// Inserts the event into the outbox in this transaction and returns its event id.
    ///
    /// The event is validated and serialized when `emit` is called; the returned future only
    /// does the insert (and borrows nothing from the event).
    pub fn emit<E: OutboxEvent + ?Sized>(&mut self, event: &E) -> EmitFuture<'_, Uuid> {
        let record = OutboxRecord::from_event(event).map(|r| vec![r]);
        Box::pin(async move { Ok(self.write(record).await?[0]) })
    }

    /// Inserts many events with one statement (one round trip) and returns their event ids in
    /// order. Takes `&E` for any event type, or [`OutboxRecord`]s to mix several types.
    pub fn emit_all<I>(&mut self, events: I) -> EmitFuture<'_, Vec<Uuid>>
    where
        I: IntoIterator,
        I::Item: IntoRecord,
    {
        let records = into_records(events);
        Box::pin(self.write(records))
    }

    async fn write(&mut self, records: Result<Vec<OutboxRecord>>) -> Result<Vec<Uuid>> {
        if let Some(first_error) = &self.failed {
            return Err(Error::EmitFailedEarlier {
                first_error: first_error.clone(),
            });
        }
        let result = match records {
            Ok(records) => insert(&mut self.tx, &records).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(ids) => {
                self.emitted += ids.len();
                Ok(ids)
            }
            Err(e) => {
                self.failed = Some(e.to_string());
                Err(e)
            }
        }
    }

    /// How many events this unit of work has emitted so far.
    pub fn emitted(&self) -> usize {
        self.emitted
    }

    /// Commits the domain rows and the outbox rows together.
    ///
    /// If an emit failed earlier, rolls back instead and returns [`Error::EmitFailedEarlier`].
    pub async fn commit(self) -> Result<()> {
        if let Some(first_error) = self.failed {
            self.tx.rollback().await?;
            return Err(Error::EmitFailedEarlier { first_error });
        }
        self.tx.commit().await?;
        Ok(())
    }

    /// Rolls back everything done in this unit of work.
    pub async fn rollback(self) -> Result<()> {
        self.tx.rollback().await?;
        Ok(())
    }
}

impl Deref for Uow<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for Uow<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

impl std::fmt::Debug for Uow<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uow")
            .field("emitted", &self.emitted)
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
    sqlx::query(INSERT_SQL)
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
