//! The topics an installation needs, created on a broker that does not create them itself: the
//! relay's topics, and beside each its consumers' retry and dead-letter topics.

use std::collections::BTreeSet;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::RDKafkaErrorCode;
use serde::Serialize;
use sqlx::PgPool;

use crate::error::{Error, Result};

/// What a topic is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TopicRole {
    /// A topic the relay publishes to.
    Source,
    /// A retry topic of a source topic (consumers in dedup mode with retry topics).
    Retry,
    /// The dead-letter topic of a source topic.
    DeadLetter,
}

/// What [`EnsureTopics::run`] did about a topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TopicAction {
    /// It existed already; left as it is.
    Exists,
    /// Created.
    Created,
    /// Missing; a dry run would have created it.
    WouldCreate,
}

/// One topic of the plan and what happened to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct EnsuredTopic {
    /// The topic.
    pub topic: String,
    /// What it is for.
    pub role: TopicRole,
    /// The source topic it belongs to (itself for a source topic).
    pub source: String,
    /// Its partitions: as it has them, or as created.
    pub partitions: i32,
    /// What was done.
    pub action: TopicAction,
}

/// Creates the topics an installation needs on its broker, for brokers that do not create
/// topics on first use (most production clusters): every source topic (those named with
/// [`topic`](Self::topic), and those of rows waiting in the outbox: unpublished, held for a
/// missing topic), and beside each its retry topic(s) and dead-letter topic, with the source
/// topic's partition count. Existing topics are left as they are. The suffixes and retry tiers
/// must match the consumers' (`ConsumerBuilder::dlq_suffix`, `retry_suffix`, `retry_tiers`;
/// their defaults are these').
///
/// A missing source topic is created with [`partitions`](Self::partitions) partitions; without
/// it, `run` refuses to guess and names the topic. The replication factor is the broker's
/// default unless [`replication_factor`](Self::replication_factor) says otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct EnsureTopics {
    topics: BTreeSet<String>,
    partitions: Option<i32>,
    replication_factor: i32,
    retry_suffix: String,
    retry_tiers: u32,
    dlq_suffix: String,
    dry_run: bool,
}

impl Default for EnsureTopics {
    fn default() -> Self {
        EnsureTopics {
            topics: BTreeSet::new(),
            partitions: None,
            replication_factor: -1,
            retry_suffix: ".retry".into(),
            retry_tiers: 1,
            dlq_suffix: ".dlq".into(),
            dry_run: false,
        }
    }
}

/// How long the broker gets for each request.
const WITHIN: Duration = Duration::from_secs(30);

impl EnsureTopics {
    /// The defaults: the outbox's waiting rows' topics, one retry tier, `.retry` and `.dlq`.
    pub fn new() -> Self {
        Self::default()
    }

    /// A source topic to ensure besides those of the outbox's waiting rows (repeatable).
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topics.insert(topic.into());
        self
    }

    /// Partitions of a source topic that must be created.
    pub fn partitions(mut self, partitions: i32) -> Self {
        self.partitions = Some(partitions);
        self
    }

    /// The replication factor of the topics created (default: the broker's).
    pub fn replication_factor(mut self, factor: i32) -> Self {
        self.replication_factor = factor;
        self
    }

    /// Retry topics per source topic (default 1: `<topic>.retry`; with `n` > 1,
    /// `<topic>.retry-1` to `-n`; 0: none, for consumers that retry in place or in inbox mode).
    pub fn retry_tiers(mut self, tiers: u32) -> Self {
        self.retry_tiers = tiers;
        self
    }

    /// The retry topics' suffix (default `.retry`).
    pub fn retry_suffix(mut self, suffix: impl Into<String>) -> Self {
        self.retry_suffix = suffix.into();
        self
    }

    /// The dead-letter topic's suffix (default `.dlq`).
    pub fn dlq_suffix(mut self, suffix: impl Into<String>) -> Self {
        self.dlq_suffix = suffix.into();
        self
    }

    /// Creates nothing; says what it would create.
    pub fn dry_run(mut self, dry_run: bool) -> Self {
        self.dry_run = dry_run;
        self
    }

    /// The retry and dead-letter topics of `source`.
    fn beside(&self, source: &str) -> Vec<(String, TopicRole)> {
        let mut topics: Vec<(String, TopicRole)> = match self.retry_tiers {
            0 => Vec::new(),
            1 => vec![(format!("{source}{}", self.retry_suffix), TopicRole::Retry)],
            n => (1..=n)
                .map(|tier| {
                    (
                        format!("{source}{}-{tier}", self.retry_suffix),
                        TopicRole::Retry,
                    )
                })
                .collect(),
        };
        topics.push((
            format!("{source}{}", self.dlq_suffix),
            TopicRole::DeadLetter,
        ));
        topics
    }

    /// Looks at the broker (with `config`: at least `bootstrap.servers`, plus its security
    /// settings) and creates what is missing, sources first. Returns every topic of the plan,
    /// sources in name order, each followed by its retry and dead-letter topics. A consumer's
    /// record of a missing retry or dead-letter topic (what `outbox status` warns about) is
    /// cleared once the topic exists.
    pub async fn run(&self, pool: &PgPool, config: &ClientConfig) -> Result<Vec<EnsuredTopic>> {
        if self.partitions.is_some_and(|p| p < 1) {
            return Err(Error::Config("partitions must be at least 1".into()));
        }
        if self.replication_factor == 0 || self.replication_factor < -1 {
            return Err(Error::Config(
                "replication_factor must be at least 1 (or -1: the broker's default)".into(),
            ));
        }
        if self.retry_suffix.is_empty() || self.dlq_suffix.is_empty() {
            return Err(Error::Config(
                "the retry and dead-letter suffixes cannot be empty".into(),
            ));
        }
        let waiting: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT topic FROM outbox_event \
             WHERE published_at IS NULL AND parked_at IS NULL",
        )
        .fetch_all(pool)
        .await?;
        let sources: BTreeSet<String> = self.topics.iter().cloned().chain(waiting).collect();

        let admin: AdminClient<DefaultClientContext> =
            config.create().map_err(|source| Error::KafkaClient {
                client: "admin client",
                source,
            })?;
        let admin = std::sync::Arc::new(admin);
        let asking = std::sync::Arc::clone(&admin);
        let existing = tokio::task::spawn_blocking(move || {
            super::metadata::existing_topics(asking.inner(), WITHIN)
        })
        .await
        .map_err(|source| Error::Task {
            task: "reading the broker's topics",
            source,
        })?
        .map_err(|source| Error::KafkaClient {
            client: "admin client",
            source,
        })?;

        let mut plan = Vec::new();
        for source in &sources {
            let partitions = match existing.get(source) {
                Some(&n) => n,
                None => self.partitions.ok_or_else(|| {
                    Error::Config(format!(
                        "topic `{source}` does not exist: say how many partitions it gets \
                         (partitions / --partitions)"
                    ))
                })?,
            };
            plan.push((
                source.clone(),
                TopicRole::Source,
                source.clone(),
                partitions,
            ));
            for (topic, role) in self.beside(source) {
                let partitions = existing.get(&topic).copied().unwrap_or(partitions);
                plan.push((topic, role, source.clone(), partitions));
            }
        }

        let missing: Vec<&(String, TopicRole, String, i32)> = plan
            .iter()
            .filter(|(topic, ..)| !existing.contains_key(topic))
            .collect();
        if !self.dry_run && !missing.is_empty() {
            let new: Vec<NewTopic<'_>> = missing
                .iter()
                .map(|(topic, _, _, partitions)| {
                    NewTopic::new(
                        topic,
                        *partitions,
                        TopicReplication::Fixed(self.replication_factor),
                    )
                })
                .collect();
            let options = AdminOptions::new()
                .request_timeout(Some(WITHIN))
                .operation_timeout(Some(WITHIN));
            let results = admin
                .create_topics(&new, &options)
                .await
                .map_err(|source| Error::KafkaClient {
                    client: "admin client",
                    source,
                })?;
            for result in results {
                match result {
                    Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                    Err((topic, code)) => {
                        return Err(Error::Config(format!(
                            "the broker refused to create topic `{topic}`: {code}"
                        )))
                    }
                }
            }
        }

        let ensured: Vec<EnsuredTopic> = plan
            .into_iter()
            .map(|(topic, role, source, partitions)| {
                let action = match (existing.contains_key(&topic), self.dry_run) {
                    (true, _) => TopicAction::Exists,
                    (false, false) => TopicAction::Created,
                    (false, true) => TopicAction::WouldCreate,
                };
                EnsuredTopic {
                    topic,
                    role,
                    source,
                    partitions,
                    action,
                }
            })
            .collect();
        if !self.dry_run {
            let present: Vec<&str> = ensured.iter().map(|t| t.topic.as_str()).collect();
            sqlx::query("DELETE FROM outbox_consumer_missing_topic WHERE topic = ANY($1)")
                .bind(&present)
                .execute(pool)
                .await?;
        }
        Ok(ensured)
    }
}
