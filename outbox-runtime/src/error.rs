use std::borrow::Cow;

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
        event_type: Cow<'static, str>,
        reason: Cow<'static, str>,
    },

    /// The event's payload does not serialize to JSON.
    #[error("cannot emit `{event_type}`: payload does not serialize to JSON: {source}")]
    Payload {
        event_type: Cow<'static, str>,
        #[source]
        source: serde_json::Error,
    },

    /// The database refused the outbox insert. The transaction is aborted.
    #[error("cannot emit `{event_type}`: {source}")]
    Emit {
        event_type: Cow<'static, str>,
        #[source]
        source: sqlx::Error,
    },

    /// The commit that writes the pending outbox rows failed; nothing of the unit of work was
    /// written.
    #[error("unit of work not committed (it emitted `{event_types}`): {source}")]
    Commit {
        event_types: Cow<'static, str>,
        #[source]
        source: sqlx::Error,
    },

    /// `commit` was called on a unit of work whose emit had failed: it was rolled back instead.
    #[error(
        "unit of work rolled back, not committed: an emit in it failed earlier ({first_error})"
    )]
    EmitFailedEarlier { first_error: String },

    /// A migration failed to apply; nothing of it (or of those after it) was applied.
    #[error("migration {version} ({description}) failed: {source}")]
    Migration {
        version: i64,
        description: &'static str,
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
        version: i64,
        description: &'static str,
        applied: i64,
        embedded: i64,
    },

    /// Invalid configuration, found by a builder's `build`.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// Records were not acknowledged by Kafka for a passing reason (broker down, timeout); they
    /// stay unpublished and are retried.
    #[error("publishing to Kafka failed, will retry: {0}")]
    Publish(String),

    /// A replay stopped: a record was not acknowledged. The message says how far it got.
    #[error("replay stopped: {0}")]
    Replay(String),

    /// A Kafka client error.
    #[cfg(feature = "kafka")]
    #[error("kafka error: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),

    /// Any other database error (its message says so).
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}
