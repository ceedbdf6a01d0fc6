//! A consumer's settings: what its builder sets and checks, kept whole by the running
//! consumer, with what follows from them (the dead-letter topics' names, the backoff
//! schedules). A broker's own settings are in its folder.

use std::time::Duration;

use crate::config::Backoff;
use crate::error::{Error, Result};

/// How a consumer hands messages to its handlers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Mode {
    /// Handle each message at once, deduplicated through `processed_event`.
    #[default]
    Dedup,
    /// Store messages in `inbox_event` first; processor tasks handle them at their own pace.
    Inbox,
}

/// What a dedup-mode consumer does with a message whose handler failed retryably.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RetryPolicy {
    /// Send it to its retry topic (`<topic>.retry`), store its offset and go on: its
    /// partition flows on, and the consumer (which also reads the retry topic) tries it again
    /// once its backoff has passed; after `max_attempts`, its dead-letter topic. A retried
    /// message is handled after its key's later messages. The style guide's choice for
    /// ordinary consumers (R-DIST-OBX-2).
    #[default]
    Topic,
    /// Retry it where it is, with backoff, before anything after it in the consumer's batch:
    /// strict per-key order, but a failing message holds up every partition of the consumer
    /// meanwhile. For flows whose handlers need one key's events in order.
    InPlace,
}

/// A consumer's settings (see [`ConsumerBuilder`](super::ConsumerBuilder) for each), with
/// its defaults.
pub(crate) struct Settings {
    /// The consumer group (`group_id`, or what the broker's settings name).
    pub(crate) group: String,
    pub(crate) mode: Mode,
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
    pub(crate) retry_policy: RetryPolicy,
    pub(crate) topics: Topics,
    pub(crate) processors: usize,
    pub(crate) batch_size: usize,
    pub(crate) poll_interval: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            group: String::new(),
            mode: Mode::Dedup,
            max_attempts: 5,
            backoff: Backoff {
                first: Duration::from_millis(200),
                max: Duration::from_secs(30),
            },
            retry_policy: RetryPolicy::Topic,
            topics: Topics {
                dlq_suffix: ".dlq".into(),
                retry_suffix: ".retry".into(),
                retry_tiers: 1,
            },
            processors: 1,
            batch_size: 500,
            poll_interval: Duration::from_millis(200),
        }
    }
}

impl Settings {
    /// `Err(Error::Config)` names the first setting that cannot work.
    pub(crate) fn check(&self) -> Result<()> {
        let fail = |msg: String| Err(Error::Config(msg));
        crate::config::check_common(
            self.batch_size,
            self.poll_interval,
            self.max_attempts,
            self.backoff,
        )?;
        if self.group().is_empty() {
            return fail("no consumer group: call `group_id(...)`".into());
        }
        let topics = &self.topics;
        if topics.dlq_suffix.is_empty() || topics.retry_suffix.is_empty() {
            return fail("the dead-letter and retry suffixes must not be empty".into());
        }
        if topics.dlq_suffix == topics.retry_suffix {
            return fail("the dead-letter and retry suffixes must differ".into());
        }
        if topics.retry_tiers == 0 || topics.retry_tiers > 100 {
            return fail(format!(
                "retry_tiers must be between 1 and 100, not {}",
                topics.retry_tiers
            ));
        }
        Ok(())
    }

    /// The consumer group.
    pub(crate) fn group(&self) -> &str {
        &self.group
    }

    /// Whether a failed message goes to a retry topic (dedup mode, [`RetryPolicy::Topic`]).
    #[allow(dead_code)] // read by the brokers with retry topics
    pub(crate) fn retries_through_topics(&self) -> bool {
        self.mode == Mode::Dedup && self.retry_policy == RetryPolicy::Topic
    }

    /// The wait before a message's next attempt after its `attempt`-th failure.
    pub(crate) fn backoff(&self, attempt: u32) -> Duration {
        self.backoff.delay(attempt)
    }

    /// The wait after the `failures`-th failure in a row of the database or the broker:
    /// jittered, so that the consumers an outage stopped together do not retry in lockstep.
    pub(crate) fn outage_backoff(&self, failures: u32) -> Duration {
        self.backoff.jittered(failures)
    }
}

/// The names of a topic's retry and dead-letter topics.
#[derive(Debug, Clone)]
pub(crate) struct Topics {
    pub(crate) dlq_suffix: String,
    pub(crate) retry_suffix: String,
    pub(crate) retry_tiers: u32,
}

impl Topics {
    /// The dead-letter topic of source topic `source`.
    pub(crate) fn dead_letter(&self, source: &str) -> String {
        format!("{source}{}", self.dlq_suffix)
    }
}
