//! Settings shared by the relay and the consumers, and their checks.

use std::time::Duration;

use crate::error::{Error, Result};

/// Exponential backoff: `first`, doubling with each attempt, at most `max`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

impl Backoff {
    /// The wait after failed attempt number `attempt` (1 for the first).
    pub(crate) fn delay(&self, attempt: u32) -> Duration {
        let factor = 2u32.saturating_pow(attempt.saturating_sub(1).min(20));
        self.first.saturating_mul(factor).min(self.max)
    }
}

/// Checks the settings every worker builder has; `Err(Error::Config)` names the first problem.
pub(crate) fn check_common(
    brokers: Option<&str>,
    batch_size: usize,
    poll_interval: Duration,
    max_attempts: u32,
    backoff: Backoff,
) -> Result<()> {
    let problem = if brokers.is_none_or(str::is_empty) {
        "no Kafka brokers: call `brokers(...)` or set bootstrap.servers".to_owned()
    } else if batch_size == 0 || batch_size > 100_000 {
        format!("batch_size must be between 1 and 100000, not {batch_size}")
    } else if poll_interval.is_zero() {
        "poll_interval must be more than zero".to_owned()
    } else if max_attempts == 0 {
        "max_attempts must be at least 1".to_owned()
    } else if backoff.first.is_zero() || backoff.max < backoff.first {
        format!(
            "retry_backoff must be more than zero and at most its maximum ({:?} and {:?})",
            backoff.first, backoff.max
        )
    } else {
        return Ok(());
    };
    Err(Error::Config(problem))
}
