//! MariaDB 10.6+ and MySQL 8.0.1+ as the service's database (feature `mysql`).
//!
//! So far the unit of work, the migrations (also `outbox migrate` with a `mysql://` URL), the
//! relay and dedup-mode consumers: a command handler on MariaDB or MySQL emits its events in its
//! own transaction, exactly as on PostgreSQL,
//! [`Relay::builder(mysql_pool)`](crate::relay::Relay::builder) publishes them to any broker, and
//! [`Consumer::builder(mysql_pool)`](crate::inbox::Consumer::builder) hands what it reads from
//! Kafka, RabbitMQ or NATS JetStream to handlers that take `&mut sqlx::MySqlConnection`. The rest comes next
//! (issue 38; `docs/design/mariadb.md` is the plan).
//!
//! ```no_run
//! use outbox_runtime::inbox::{Consumer, HandlerError};
//! # #[derive(serde::Serialize, serde::Deserialize, outbox_runtime::OutboxEvent)]
//! # #[outbox(topic = "payment.events", aggregate_type = "Payment")]
//! # struct PaymentSucceeded { #[outbox(aggregate_id)] payment_id: uuid::Uuid, order_id: uuid::Uuid }
//!
//! #[outbox_runtime::inbox_handler]
//! async fn mark_order_paid(
//!     event: PaymentSucceeded,
//!     tx: &mut sqlx::MySqlConnection,
//! ) -> Result<(), HandlerError> {
//!     sqlx::query("UPDATE orders SET paid = 1 WHERE id = ?")
//!         .bind(event.order_id)
//!         .execute(tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! # fn f(pool: sqlx::MySqlPool) -> outbox_runtime::Result<()> {
//! let consumer = Consumer::builder(pool)      // a MySqlPool: handlers take MySqlConnection
//!     .brokers("127.0.0.1:9092")
//!     .group_id("orders-service")
//!     .handler(mark_order_paid)
//!     .build()?;
//! # Ok(()) }
//! ```
//!
//! ```no_run
//! # use outbox_runtime::{OutboxEvent, Uow};
//! # #[derive(serde::Serialize, OutboxEvent)]
//! # #[outbox(topic = "order.events", aggregate_type = "Order")]
//! # struct OrderCreated { #[outbox(aggregate_id)] order_id: uuid::Uuid }
//! # async fn f(pool: sqlx::MySqlPool, order_id: uuid::Uuid) -> Result<(), Box<dyn std::error::Error>> {
//! outbox_runtime::mysql::migrate(&pool).await?;
//! let mut uow = Uow::begin(&pool).await?;
//! sqlx::query("INSERT INTO orders (id) VALUES (?)").bind(order_id).execute(uow.tx()).await?;
//! uow.emit(&OrderCreated { order_id }).await?;
//! uow.commit().await?;
//! # Ok(()) }
//! ```
//!
//! # What differs from PostgreSQL
//!
//! - **No aborted state.** InnoDB rolls a deadlocked transaction back whole, and the session
//!   goes on in autocommit: an application that catches the error and continues writes alone.
//!   Every write of outbox rows and every commit of a unit of work first checks that the session
//!   is still in a transaction, in the same round trip; if not, it fails with
//!   [`Error::NotInTransaction`](crate::Error::NotInTransaction) and writes nothing. A session
//!   with `autocommit=0` is refused: there the statement after such a rollback begins the next
//!   transaction silently, and no check could tell.
//! - **Per-key order through row locks.** There is no transaction-scoped named lock: an emit
//!   locks its keys' rows of `outbox_key_lock` (65,536 buckets, created by the migration) before
//!   inserting, so a key's `AUTO_INCREMENT` ids are in commit order.
//! - **Size.** An event's text (payload, headers, ids) is at most 7 MiB, refused at `emit`
//!   beyond: written as hex, it stays within MariaDB's default `max_allowed_packet` (16 MiB).
//! - **Round trips.** A unit of work's commit writes its rows and commits in one round trip, as
//!   on PostgreSQL; [`flush`](crate::Uow::flush) and the functions below write in one (very large
//!   writes take one per 4 MiB). An emit outside a transaction is refused: begin one.
//! - **The relay keeps no cursor.** `AUTO_INCREMENT` ids are taken at insert, so a lower id
//!   can become visible after a higher one; every claim reads the owned shards' unpublished rows
//!   from the first (an index on `published_at, parked_at, id, key_bucket`), so such a row is published by
//!   the next batch, and a key's order holds (the key lock above). Claims run at READ COMMITTED
//!   (no gap locks that would stall emitters); a server logging statements
//!   (`binlog_format=STATEMENT`) is refused, saying what to set.
//! - **Shards through named locks.** A relay instance owns its shards with `GET_LOCK` on its own
//!   session (`wait_timeout` set to the failover timeout), so a relay that dies, is killed
//!   (`KILL CONNECTION`) or goes silent frees them; the server rolls the session's transaction
//!   back before it frees them, so its claimed rows are free first.
//! - **Wake-up without `NOTIFY`.** A unit of work committed in the relay's process wakes it at
//!   once, and so does a consumer's batch that ran handlers (which may have emitted with
//!   [`emit`]); otherwise the relay polls, 5 ms after the last rows it found, doubling up to its
//!   `poll_interval` while it finds none (2 claims a second per idle relay at the default
//!   500 ms). Units of work of another process are seen within that interval.
//! - **Health**: [`health`] (`outbox status --check`) warns of old unpublished rows, held keys
//!   and parked rows as on PostgreSQL, and of transactions open too long, which hold InnoDB's
//!   purge back (and make the relay's claims walk what it has not purged), with the history
//!   list length; it needs the `PROCESS` privilege and says so without it.
//! - **Consumers, dedup mode.** A batch is one transaction at READ COMMITTED and one commit, as
//!   on PostgreSQL, its `processed_event` rows written in two round trips (the pairs it holds
//!   already, then the new ones), its handlers run straight. After a handler fails, the batch is
//!   done again with each handler behind a savepoint of its own (a failed statement undoes only
//!   itself there, so no further fallback is needed): a failing handler undoes its own work and
//!   dedup row, and the rest commits. No named lock is needed: `processed_event` is not
//!   partitioned, and its primary key makes a second consumer of the same message wait, then
//!   skip it.
//! - **A deadlock a handler swallows is found.** InnoDB rolls the whole batch back on a deadlock
//!   (1213, or a lock wait timeout with `innodb_rollback_on_timeout`). A batch runs with
//!   `autocommit` off, so what a handler writes after catching it does not commit on its own;
//!   the batch finds its savepoint gone at the commit, rolls that back, finds the handler, fails
//!   its message (its retry says why) and commits the rest. The connection goes back to the pool
//!   with `autocommit` on again, or is closed. `mysql::emit` works in a handler (the batch sets
//!   `@outbox_consumer_batch`, which tells it the batch checks the transaction).
//! - **A statement that commits on its own** (DDL, `COMMIT`, `LOCK TABLES`) has no place in a
//!   handler: the batch finds it as above, and loses nothing (no dedup row is written before
//!   its handler ran), but what the handlers before it in the batch did commits without their
//!   rows, and runs again.
//! - **Operators**: parked rows are listed, retried and dropped with the same [`PoisonFilter`]
//!   as on PostgreSQL ([`list_parked`], [`retry_parked`], [`drop_parked`]; `outbox parked` with
//!   a `mysql://` URL): a retried row is claimed by the relays' next claim (no cursor passes
//!   it); relays of another process find it within their poll interval. A
//!   [`Replay`](crate::admin::Replay) takes a `MySqlPool` as it takes a `PgPool` (`outbox
//!   replay` with a `mysql://` URL).
//! - **The relay's health checks** run on its schedule as on PostgreSQL
//!   ([`RelayBuilder::health_interval`](crate::relay::RelayBuilder::health_interval)): [`health`]
//!   without counting `processed_event`, each warning logged and counted in
//!   `outbox_health_warnings{kind}`. A relay whose user lacks `PROCESS` leaves out the checks of
//!   InnoDB's transactions (saying so once) and makes the backlog's.
//! - **JetStream consumers' leases on two rows.** One instance of a group reads a JetStream
//!   topic at a time, under a lease as on PostgreSQL, but InnoDB's shared row lock blocks every
//!   update of the row, where PostgreSQL's `FOR KEY SHARE` lets the holder's renewals through.
//!   So the lease's time is one row (`outbox_consumer_lease`, renewed), and the name every batch
//!   transaction checks is another (`outbox_consumer_fence`, read `LOCK IN SHARE MODE` in the
//!   round trip that reads the batch's dedup rows, and written only when the lease changes
//!   hands): no instance takes the lease over while a batch of the holder runs, and the former
//!   holder's next batch commits nothing. Unlike PostgreSQL's, the fence does not check expiry:
//!   a holder whose lease expired commits until another instance takes it over. Not on Galera
//!   (its row locks are per node). [`status`] lists the leases.
//! - **Not yet on these databases**: inbox mode (refused at `build`, saying so); and the
//!   operator commands other than `migrate`, `relay`, `status` (its figures: [`status`]),
//!   `cleanup`, `parked` and `replay` (the console, `inbox dead`, `partitions`).
//! - **Retention** ([`Cleanup`], `outbox cleanup` with a `mysql://` URL, or beside the relay:
//!   [`RelayBuilder::retention`](crate::relay::RelayBuilder::retention), one relay of the
//!   database at a time through `GET_LOCK`): published outbox rows and dedup rows past a
//!   cut-off, deleted in batches of 10,000 (`DELETE ... ORDER BY <age> LIMIT`), each its own
//!   transaction at READ COMMITTED. Neither table is partitioned here.
//! - **Migrations** are not transactional (DDL commits on its own): each statement can run
//!   again after a migration cut short, and `GET_LOCK` serializes concurrent runners.
//!
//! [`PoisonFilter`]: crate::admin::PoisonFilter

pub(crate) mod emit;
mod migrate;
#[cfg(feature = "_broker")]
pub(crate) mod relay;
#[cfg(feature = "_broker")]
pub(crate) mod wake;

use uuid::Uuid;

pub use crate::admin::mysql::{health, status};
pub use crate::admin::mysql_cleanup::MySqlCleanup as Cleanup;
pub use crate::admin::poison_mysql::{
    count_parked, drop_parked, list_parked, retry_parked, retry_parked_by,
};
pub use migrate::{migrate, migrate_on, pending, MIGRATIONS};

use crate::event::{IntoRecord, OutboxEvent, OutboxRecord};
use crate::uow::{into_records, EmitDatabase, EmitFuture};

/// How many times this process's relays on these databases were signalled that rows may have
/// committed. A hook of this project's own tests (feature `testing`); not API.
#[cfg(all(feature = "testing", feature = "_broker"))]
#[doc(hidden)]
pub fn relay_wakeups() -> u64 {
    wake::signalled()
}

/// Inserts one event into the outbox on a MariaDB or MySQL connection the application manages,
/// e.g. `outbox_runtime::mysql::emit(&mut tx, &event)` with `tx: sqlx::Transaction<'_, MySql>`.
///
/// The row commits with that transaction. Outside a transaction it is refused
/// ([`Error::NotInTransaction`](crate::Error::NotInTransaction)): see the module's docs.
pub fn emit<'c, E: OutboxEvent + ?Sized>(
    conn: &'c mut sqlx::MySqlConnection,
    event: &E,
) -> EmitFuture<'c, Uuid> {
    let record = OutboxRecord::from_event(event);
    Box::pin(async move { Ok(write_checked(conn, vec![record?]).await?[0]) })
}

/// [`emit`] with the application's headers; see [`Uow::emit_with`](crate::Uow::emit_with).
pub fn emit_with<'c, E, I, K, V>(
    conn: &'c mut sqlx::MySqlConnection,
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
    Box::pin(async move { Ok(write_checked(conn, vec![record?]).await?[0]) })
}

/// Inserts many events, in order, on a connection the application manages; see [`emit`].
pub fn emit_all<I>(conn: &mut sqlx::MySqlConnection, events: I) -> EmitFuture<'_, Vec<Uuid>>
where
    I: IntoIterator,
    I::Item: IntoRecord,
{
    let records = into_records(events);
    Box::pin(async move { write_checked(conn, records?).await })
}

/// The emit functions' write: each row checked against the columns first, as a unit of work
/// checks it when it is emitted (so the write itself checks nothing again).
async fn write_checked(
    conn: &mut sqlx::MySqlConnection,
    records: Vec<OutboxRecord>,
) -> crate::Result<Vec<Uuid>> {
    records.iter().try_for_each(sqlx::MySql::check)?;
    sqlx::MySql::write(conn, &records).await
}
