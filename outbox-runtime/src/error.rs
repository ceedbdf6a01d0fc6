use std::borrow::Cow;

/// " (it emitted `A`, `B`)", or nothing when no event was pending.
fn emitted(event_types: &str) -> String {
    if event_types.is_empty() {
        String::new()
    } else {
        format!(" (it emitted `{event_types}`)")
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `outbox-runtime`.
///
/// Every error of an emit names the event type, and none leaves a half-written transaction
/// behind: the unit of work refuses to commit after a failed emit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The event is not valid: an empty partition key or aggregate id, say.
    #[error("cannot emit `{event_type}`: {reason}")]
    InvalidEvent {
        /// The event's type.
        event_type: Cow<'static, str>,
        /// What is wrong with it, e.g. "partition key is empty".
        reason: Cow<'static, str>,
    },

    /// The event's payload does not serialize to JSON.
    #[error("cannot emit `{event_type}`: its payload does not serialize to JSON")]
    Payload {
        /// The event's type.
        event_type: Cow<'static, str>,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },

    /// The database refused the outbox insert. The transaction is aborted.
    #[error("cannot emit `{event_type}`: the database refused the outbox insert")]
    Emit {
        /// The event's type; for rows written together, their distinct types, separated by
        /// `` `, ` ``.
        event_type: Cow<'static, str>,
        /// The database's error.
        #[source]
        source: sqlx::Error,
    },

    /// The database refused the pending outbox rows or the commit (a constraint checked at
    /// commit, a serialization failure, ...): nothing of the unit of work was written.
    #[error("unit of work not committed{}", emitted(.event_types))]
    Commit {
        /// The distinct types of the events still pending at commit, separated by `` `, ` ``
        /// (empty if there were none).
        event_types: Cow<'static, str>,
        /// The database's error.
        #[source]
        source: sqlx::Error,
    },

    /// A statement of the unit of work failed and PostgreSQL aborted its transaction, but the
    /// error did not stop the unit of work (it was caught and ignored): it was rolled back,
    /// nothing was written. A statement whose failure the application handles must run in a
    /// savepoint (`conn.begin()`), or avoid the error (`ON CONFLICT`).
    #[error(
        "unit of work rolled back, not committed{}: a statement in it failed and aborted the \
         transaction, but its error was not propagated; run a statement whose failure you \
         handle in a savepoint (`conn.begin()`) or avoid the error (`ON CONFLICT`)",
        emitted(.event_types)
    )]
    Aborted {
        /// The distinct types of the events still pending at commit, separated by `` `, ` ``
        /// (empty if there were none).
        event_types: Cow<'static, str>,
    },

    /// MariaDB or MySQL: the connection was not in a transaction when the outbox rows were to
    /// be written or committed. None was begun, or the server rolled the unit of work's
    /// transaction back (a deadlock; a lock wait timeout with `innodb_rollback_on_timeout`)
    /// and the error was not propagated: statements run since then committed alone, outside
    /// it. No outbox row was written; the unit of work did not commit.
    #[error(
        "not committed{}: the connection is not in a transaction: none was begun, or the \
         server rolled it back (a deadlock) and the error was not propagated, so statements \
         since then ran outside it; no outbox row was written",
        emitted(.event_types)
    )]
    NotInTransaction {
        /// The distinct types of the events that were to be written, separated by `` `, ` ``
        /// (empty if there were none).
        event_types: Cow<'static, str>,
    },

    /// The connection failed after `COMMIT` was sent: the unit of work may or may not have
    /// committed. Check (by a key the unit of work wrote) before doing it again.
    #[error(
        "the connection failed during commit: the unit of work may have committed or not{}; \
         check before retrying",
        emitted(.event_types)
    )]
    CommitOutcomeUnknown {
        /// The distinct types of the events still pending at commit, separated by `` `, ` ``
        /// (empty if there were none).
        event_types: Cow<'static, str>,
        /// The error the commit failed with.
        #[source]
        source: sqlx::Error,
    },

    /// `commit` was called on a unit of work whose emit had failed: it was rolled back instead.
    #[error(
        "unit of work rolled back, not committed: an emit in it failed earlier ({first_error})"
    )]
    EmitFailedEarlier {
        /// The first failed emit's error and its causes, on one line (see [`error_chain`]).
        first_error: String,
    },

    /// A migration failed to apply; nothing of it (or of those after it) was applied.
    #[error("migration {version} ({description}) failed")]
    Migration {
        /// The migration's version (the number its file name starts with).
        version: i64,
        /// The migration's description (the rest of its file name).
        description: &'static str,
        /// The database's error.
        #[source]
        source: sqlx::Error,
    },

    /// An applied migration differs from the one this build embeds.
    #[error(
        "migration {version} ({description}) was applied with different contents \
         (checksum {applied:#x}, this build has {embedded:#x}); \
         applied migrations must never be edited"
    )]
    MigrationChanged {
        /// The migration's version (the number its file name starts with).
        version: i64,
        /// The migration's description (the rest of its file name).
        description: &'static str,
        /// The checksum recorded in `outbox_schema_migrations` when it was applied.
        applied: i64,
        /// The [checksum](crate::migrate::Migration::checksum) of this build's copy of it.
        embedded: i64,
    },

    /// Invalid configuration, found by a builder's `build`: the message says which setting
    /// and why.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// librdkafka refused to create a client (a setting it does not know or accept).
    #[cfg(feature = "kafka")]
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    #[error("cannot create the Kafka {client}")]
    KafkaClient {
        /// "producer" or "consumer".
        client: &'static str,
        /// librdkafka's error.
        #[source]
        source: rdkafka::error::KafkaError,
    },

    /// Records were not acknowledged by the broker (Kafka, JetStream) for a passing reason
    /// (broker down, timeout); they stay unpublished and are retried.
    #[cfg(feature = "_broker")]
    #[error("publishing to the broker failed, will retry")]
    Publish(#[source] PublishError),

    /// A replay stopped: a record was not acknowledged. The records before it were sent.
    #[cfg(feature = "_broker")]
    #[error(
        "replay stopped: outbox row {id} (event {event_id}) was not acknowledged, after {sent} \
         records"
    )]
    Replay {
        /// The outbox row that was not acknowledged.
        id: i64,
        /// Its event id.
        event_id: uuid::Uuid,
        /// Records acknowledged before it.
        sent: u64,
        /// Why it was not acknowledged.
        #[source]
        source: PublishError,
    },

    /// A Kafka client error.
    #[cfg(feature = "kafka")]
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    #[error("the Kafka client failed")]
    Kafka(#[from] rdkafka::error::KafkaError),

    /// The Prometheus endpoint could not be served (its address is taken, or a `metrics`
    /// recorder is installed already).
    #[cfg(feature = "prometheus")]
    #[cfg_attr(docsrs, doc(cfg(feature = "prometheus")))]
    #[error("cannot serve metrics on {addr}")]
    Metrics {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// Why: the address could not be bound, or a `metrics` recorder was installed already.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// A background task of a consumer (an inbox processor) panicked or was cancelled.
    #[error("{task} panicked or was cancelled")]
    Task {
        /// Which task.
        task: &'static str,
        /// How it ended: its panic or cancellation.
        #[source]
        source: tokio::task::JoinError,
    },

    /// Any other database error (its message says so).
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Why a record was not acknowledged by the broker.
#[cfg(feature = "_broker")]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The Kafka broker or client refused or failed it.
    #[cfg(feature = "kafka")]
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    #[error(transparent)]
    Kafka(rdkafka::error::KafkaError),
    /// The Kafka producer or broker refused the record as too large (librdkafka's
    /// `MessageSizeTooLarge`, which it words as the broker's even when the producer refused the
    /// record itself), and what the relay knows beside it: who refused it, the record's sizes,
    /// the limit it met.
    #[cfg(feature = "kafka")]
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    #[error("{error}: {detail}")]
    KafkaTooLarge {
        /// librdkafka's error (boxed: it is large, and this variant is rare).
        error: Box<rdkafka::error::KafkaError>,
        /// Who refused it, its sizes, the limit.
        detail: Box<str>,
    },
    /// The JetStream server or the NATS client refused or failed it (the client's error and
    /// its causes, on one line).
    #[cfg(feature = "nats")]
    #[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
    #[error("JetStream: {0}")]
    JetStream(String),
    /// RabbitMQ refused it (a `nack`, a return: unroutable), or the channel or connection
    /// failed before it was confirmed.
    #[cfg(feature = "rabbitmq")]
    #[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
    #[error("RabbitMQ: {0}")]
    RabbitMq(String),
    /// Sent, not acknowledged within the publish timeout.
    #[error("no acknowledgement within the publish timeout ({0:?})")]
    Timeout(std::time::Duration),
    /// Not sent within the publish timeout (an earlier record of its key was still in flight).
    #[error("not sent within the publish timeout")]
    NotSent,
    /// The producer was dropped before the record was acknowledged.
    #[error("the producer was dropped")]
    ProducerDropped,
    /// Acknowledged without an offset (librdkafka does so for an idempotent retry it takes for
    /// a duplicate): not proof enough that the broker has it.
    #[error("acknowledged without an offset")]
    NoOffset,
}

impl Error {
    /// Whether doing the same work again may succeed: a deadlock or serialization failure, a
    /// lost or refused connection, the server shutting down, a broker that did not answer.
    /// False for [`Error::CommitOutcomeUnknown`]: that work may be done already.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Emit { source, .. } | Error::Commit { source, .. } | Error::Database(source) => {
                crate::sqlstate::DbError::of(source).is_transient()
            }
            #[cfg(feature = "_broker")]
            Error::Publish(_) => true,
            _ => false,
        }
    }

    /// Whether this is [`Error::CommitOutcomeUnknown`]: the commit may or may not have happened.
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(self, Error::CommitOutcomeUnknown { .. })
    }
}

/// Displays an error and its sources on one line, `error: cause: cause's cause`: for a log
/// line or a message that has one line for it. (This crate's errors display only themselves, as
/// `anyhow` and `eyre` expect: printed through them, each cause appears once.)
pub fn error_chain<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> impl std::fmt::Display + 'a {
    struct Chain<'a>(&'a (dyn std::error::Error + 'static));
    impl std::fmt::Display for Chain<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            let mut last = self.0.to_string();
            f.write_str(&last)?;
            let mut next = self.0.source();
            while let Some(cause) = next {
                let text = cause.to_string();
                // Some errors (sqlx's) repeat their source in their own text: say it once.
                if !last.contains(&text) {
                    write!(f, ": {text}")?;
                }
                last = text;
                next = cause.source();
            }
            Ok(())
        }
    }
    Chain(error)
}
