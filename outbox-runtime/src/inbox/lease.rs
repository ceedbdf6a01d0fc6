//! A JetStream consumer's lease on a topic (dedup mode): one instance of a group reads a
//! durable consumer at a time, so that a key's messages are handled in their order. JetStream
//! hands a durable consumer's messages to whichever instance pulls, and has no partitions to
//! assign, so the group's instances agree in the database where their work commits:
//!
//! - the holder renews its lease (`outbox_consumer_lease.expires_at`) every third of its
//!   length, and every batch transaction checks it first (on PostgreSQL also that it has not
//!   expired; on MariaDB/MySQL only that no other instance took it over), with a lock that lets renewals
//!   through but no takeover ([`Fence`]; on MariaDB/MySQL a second row, see
//!   `store/lease_mysql.rs`): an
//!   instance that lost it (stalled, cut off from the database) commits nothing more, and none
//!   takes it over (`FOR UPDATE`) while a batch of the holder runs, however long;
//! - the others wait, and take it over once it is released or expired;
//! - an owner asks JetStream for more time for the messages it works on only while its lease is
//!   valid, so that once another instance may have taken over, they become due again; an
//!   instance that starts reading while messages delivered before are unsettled waits
//!   `ack_wait` first (see `nats/consumer.rs`), so that they come again before anything newer.
//!
//! The lease's SQL is `store/lease.rs`'s (`store/lease_mysql.rs` on MariaDB/MySQL); this file
//! keeps its timing: when to try, renew or
//! give up, and until when this process counts it as owned.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::batch::Fence;
use super::database::Db;
use crate::error::Result;
use crate::store::lease::{self as store, Acquired};

/// One instance's lease on a group's topic.
pub(crate) struct Lease {
    db: Db,
    group: String,
    topic: String,
    holder: Uuid,
    length: Duration,
    /// Until when it is owned, by this process's clock (a margin before the database's
    /// `expires_at`); in the past while not owned.
    valid_until: Arc<Mutex<Instant>>,
}

impl Lease {
    pub(crate) fn new(db: Db, group: &str, topic: &str, length: Duration) -> Self {
        Lease {
            db,
            group: group.to_owned(),
            topic: topic.to_owned(),
            holder: Uuid::new_v4(),
            length,
            valid_until: Arc::new(Mutex::new(Instant::now())),
        }
    }

    /// What a batch transaction checks.
    pub(crate) fn fence(&self) -> Fence<'_> {
        Fence {
            group: &self.group,
            topic: &self.topic,
            holder: self.holder,
        }
    }

    /// Whether this process may take the lease as owned: for asking the server for more time.
    pub(crate) fn is_valid(&self) -> bool {
        Instant::now() < *self.valid_until.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns once the lease is no longer valid by this process's clock (never renewed in
    /// time, lost, released).
    pub(crate) async fn lapsed(&self) {
        loop {
            let until = *self.valid_until.lock().unwrap_or_else(|e| e.into_inner());
            if Instant::now() >= until {
                return;
            }
            tokio::time::sleep_until(until.into()).await;
        }
    }

    fn owned_from(&self, asked_at: Instant) {
        *self.valid_until.lock().unwrap_or_else(|e| e.into_inner()) =
            asked_at + self.length * 9 / 10;
    }

    fn lost(&self) {
        *self.valid_until.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// Takes the lease if it is free, released, expired or already this instance's.
    pub(crate) async fn try_acquire(&self) -> Result<Option<Acquired>> {
        let asked_at = Instant::now();
        let (group, topic) = (&self.group, &self.topic);
        let acquired = match &self.db {
            Db::Postgres(pool) => {
                store::try_acquire(pool, group, topic, self.holder, self.length).await?
            }
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                crate::store::lease_mysql::try_acquire(pool, group, topic, self.holder, self.length)
                    .await?
            }
        };
        if acquired.is_some() {
            self.owned_from(asked_at);
        }
        Ok(acquired)
    }

    /// Waits until this instance owns the lease, trying every third of its length; `None`
    /// if `cancel` fires first.
    /// A database error is warned of when it first comes and when it changes (a migration not
    /// run, a privilege missing: the topic is read by no instance of the group until it is
    /// mended), and counted in `outbox_consumer_lease_errors_total`.
    pub(crate) async fn acquire(&self, cancel: &CancellationToken) -> Option<Acquired> {
        let mut said = false;
        let mut last_error: Option<String> = None;
        loop {
            match self.try_acquire().await {
                Ok(Some(acquired)) => {
                    tracing::info!(group = %self.group, topic = %self.topic, ?acquired,
                        "this instance reads the topic for its group");
                    return Some(acquired);
                }
                Ok(None) if !said => {
                    said = true;
                    last_error = None;
                    tracing::info!(group = %self.group, topic = %self.topic,
                        "another instance of the group reads the topic; standing by");
                }
                Ok(None) => last_error = None,
                Err(e) => {
                    metrics::counter!("outbox_consumer_lease_errors_total").increment(1);
                    let error = crate::error_chain(&e).to_string();
                    if last_error.as_ref() != Some(&error) {
                        tracing::warn!(group = %self.group, topic = %self.topic, %error,
                            "cannot take the group's lease on the topic (nothing of it is read \
                             until it can be); trying again");
                    } else {
                        tracing::debug!(group = %self.group, topic = %self.topic, %error,
                            "cannot take the lease; trying again");
                    }
                    last_error = Some(error);
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return None,
                () = tokio::time::sleep(self.length / 3) => {}
            }
        }
    }

    /// Renews the lease every third of its length until `stop` fires (an expired one too, as
    /// long as no other instance took it over); stops if another instance has it (the lease
    /// then [`lapsed`](Self::lapsed)). A database error leaves it to lapse if it lasts.
    pub(crate) async fn keep(&self, stop: &CancellationToken) {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(self.length / 3) => {}
            }
            let asked_at = Instant::now();
            let (group, topic) = (&self.group, &self.topic);
            let renewed = match &self.db {
                Db::Postgres(pool) => {
                    store::renew(pool, group, topic, self.holder, self.length).await
                }
                #[cfg(feature = "mysql")]
                Db::MySql(pool) => {
                    crate::store::lease_mysql::renew(pool, group, topic, self.holder, self.length)
                        .await
                }
            };
            match renewed {
                Ok(true) => self.owned_from(asked_at),
                Ok(false) => {
                    tracing::warn!(group = %self.group, topic = %self.topic,
                        "this instance lost its lease on the topic (it expired): another reads it now");
                    self.lost();
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %crate::error_chain(&e), "cannot renew the lease; trying again")
                }
            }
        }
    }

    /// Gives the lease up (the instance stops): another takes it at once.
    pub(crate) async fn release(&self) {
        self.lost();
        let (group, topic) = (&self.group, &self.topic);
        let released = match &self.db {
            Db::Postgres(pool) => store::release(pool, group, topic, self.holder).await,
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                crate::store::lease_mysql::release(pool, group, topic, self.holder).await
            }
        };
        if let Err(e) = released {
            tracing::debug!(error = %crate::error_chain(&e), "cannot release the lease; it expires");
        }
    }
}
