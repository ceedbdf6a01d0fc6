//! [`Consumer`]: subscribes, runs the mode's loop (on Kafka [`dedup`](super::dedup) or
//! [`receive`](super::receive), on JetStream [`jetstream`](super::jetstream)'s) and its
//! [`processor`](super::processor)s, commits the stored offsets when it stops.

use std::sync::Arc;

#[cfg(feature = "kafka")]
use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::processor;
use super::route::Routes;
use super::settings::{Mode, Settings};
use super::shared::{Broker, Shared};
use super::store::{inbox_status, InboxStatus};
#[cfg(feature = "kafka")]
use super::{dedup, receive, topics};
use crate::error::{Error, Result};

/// Consumes events and hands them to handlers. See the [module documentation](super).
#[derive(Clone)]
pub struct Consumer {
    shared: Arc<Shared>,
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
        pool: PgPool,
        settings: Settings,
        routes: Routes,
        broker: Broker,
    ) -> Consumer {
        Consumer {
            shared: Arc::new(Shared {
                pool,
                settings,
                routes,
                broker,
            }),
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
        // Dedup records and inbox rows go to time partitions: keep them created ahead, also
        // where no relay runs retention.
        let partitions = tokio::spawn(crate::admin::partitions::keep_ahead(
            shared.pool.clone(),
            match settings.mode {
                Mode::Dedup => crate::admin::CleanupTable::ProcessedEvent,
                Mode::Inbox => crate::admin::CleanupTable::Inbox,
            },
            cancel.child_token(),
        ));
        let processors: Vec<_> = match settings.mode {
            Mode::Dedup => Vec::new(),
            Mode::Inbox => (0..settings.processors)
                .map(|_| processor::spawn_supervised(Arc::clone(shared), cancel.clone()))
                .collect(),
        };
        let result = match &shared.broker {
            #[cfg(feature = "kafka")]
            Broker::Kafka(_) => self.consume_kafka(&cancel).await,
            #[cfg(feature = "nats")]
            Broker::JetStream(jetstream) => {
                super::jetstream::consume(shared, jetstream, &cancel).await
            }
        };
        cancel.cancel();
        partitions.abort();
        for p in processors {
            p.await.map_err(|source| Error::Task {
                task: "the inbox processor supervisor",
                source,
            })??;
        }
        result
    }

    /// Consumes from Kafka until `cancel` fires, then commits what was stored.
    #[cfg(feature = "kafka")]
    async fn consume_kafka(&self, cancel: &CancellationToken) -> Result<()> {
        let shared = &self.shared;
        let settings = &shared.settings;
        let consumer: StreamConsumer =
            settings
                .consumer_config()
                .create()
                .map_err(|source| Error::KafkaClient {
                    client: "consumer",
                    source,
                })?;
        let topics = settings.subscriptions(shared.routes.topics());
        let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;
        // Say now, not at the first failure, if a retry or dead-letter topic is missing.
        let checking = tokio::spawn(topics::watch(Arc::clone(shared), cancel.child_token()));
        let result = match settings.mode {
            Mode::Dedup => dedup::consume(shared, &consumer, cancel).await,
            Mode::Inbox => receive::consume(shared, &consumer, cancel).await,
        };
        // Commit what was stored (the database has committed all of it).
        if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
            tracing::debug!(error = %crate::error_chain(&e), "no offsets to commit on shutdown");
        }
        checking.abort();
        result
    }

    /// Runs one inbox processor until `cancel` fires (a consumer in [`Mode::Inbox`] runs
    /// `processors` of them itself).
    pub async fn run_processor(&self, cancel: CancellationToken) -> Result<()> {
        processor::run(&self.shared, cancel).await
    }

    /// Processes the inbox until no row is due, once, and returns how many rows it handled
    /// (processed or failed). For tests and scripts.
    pub async fn process_inbox_pending(&self) -> Result<u64> {
        processor::process_pending(&self.shared).await
    }

    /// Inbox backlog figures.
    pub async fn inbox_status(&self) -> Result<InboxStatus> {
        inbox_status(&self.shared.pool).await
    }
}
