//! [`Consumer`]: runs its broker's [`Source`] (which reads, hands batches to the core and
//! settles them) and its [`processor`](super::processor)s, until cancelled.

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::database::Db;
use super::processor;
use super::route::Routes;
use super::settings::{Mode, Settings};
use super::shared::Shared;
use super::source::Source;
use crate::error::{Error, Result};
use crate::store::inbox::{inbox_status, InboxStatus};

/// Consumes events and hands them to handlers. See the [module documentation](super).
#[derive(Clone)]
pub struct Consumer {
    shared: Arc<Shared>,
    /// What it reads from and sends failed messages to.
    source: Arc<dyn Source>,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("mode", &self.shared.settings.mode)
            .field("topics", &self.shared.routes.topics())
            .finish_non_exhaustive()
    }
}

impl Consumer {
    pub(super) fn new(
        db: Db,
        settings: Settings,
        routes: Routes,
        source: Box<dyn Source>,
    ) -> Consumer {
        Consumer {
            shared: Arc::new(Shared::new(db, settings, routes)),
            source: Arc::from(source),
        }
    }

    /// Runs the consumer on a tokio task until `cancel` fires; see [`run`](Self::run).
    pub fn spawn(&self, cancel: CancellationToken) -> JoinHandle<Result<()>> {
        let consumer = self.clone();
        tokio::spawn(async move { consumer.run(cancel).await })
    }

    /// Consumes until `cancel` fires. On cancel it finishes the messages (or inbox batch) in
    /// hand, commits the offsets of what the database committed, stops the processors after
    /// their batch, and returns. An inbox processor that stops on its own (it should not) is
    /// logged and restarted.
    pub async fn run(&self, cancel: CancellationToken) -> Result<()> {
        let shared = &self.shared;
        let settings = &shared.settings;
        // On PostgreSQL dedup records and inbox rows go to time partitions: keep them
        // created ahead, also where no relay runs retention.
        let partitions = match &shared.db {
            Db::Postgres(pool) => Some(tokio::spawn(crate::admin::partitions::keep_ahead(
                pool.clone(),
                match settings.mode {
                    Mode::Dedup => crate::admin::CleanupTable::ProcessedEvent,
                    Mode::Inbox => crate::admin::CleanupTable::Inbox,
                },
                cancel.child_token(),
            ))),
            #[cfg(feature = "mysql")]
            Db::MySql(_) => None,
        };
        let processors: Vec<_> = match settings.mode {
            Mode::Dedup => Vec::new(),
            Mode::Inbox => (0..settings.processors)
                .map(|_| processor::spawn_supervised(Arc::clone(shared), cancel.clone()))
                .collect(),
        };
        let result = self.source.consume(shared, &cancel).await;
        cancel.cancel();
        if let Some(partitions) = partitions {
            partitions.abort();
        }
        for p in processors {
            p.await.map_err(|source| Error::Task {
                task: "the inbox processor supervisor",
                source,
            })??;
        }
        result
    }

    /// Runs one inbox processor until `cancel` fires (a consumer in [`Mode::Inbox`] runs
    /// `processors` of them itself).
    pub async fn run_processor(&self, cancel: CancellationToken) -> Result<()> {
        self.shared.db.pg("inbox mode")?;
        processor::run(&self.shared, cancel).await
    }

    /// Processes the inbox until no row is due, once, and returns how many rows it handled
    /// (processed or failed). For tests and scripts.
    pub async fn process_inbox_pending(&self) -> Result<u64> {
        self.shared.db.pg("inbox mode")?;
        processor::process_pending(&self.shared).await
    }

    /// Inbox backlog figures.
    pub async fn inbox_status(&self) -> Result<InboxStatus> {
        inbox_status(self.shared.db.pg("inbox mode")?).await
    }
}
