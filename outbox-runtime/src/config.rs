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
    /// The wait after failed attempt number `attempt` (1 for the first): a message's retry
    /// schedule, the same every time.
    pub(crate) fn delay(&self, attempt: u32) -> Duration {
        let factor = 2u32.saturating_pow(attempt.saturating_sub(1).min(20));
        self.first.saturating_mul(factor).min(self.max)
    }

    /// The wait of a worker after its `failures`-th failure in a row (an outage): drawn at
    /// random between zero and [`delay`](Self::delay) ("full jitter"), so that the relays and
    /// consumers an outage stopped together do not all come back at the same moment.
    pub(crate) fn jittered(&self, failures: u32) -> Duration {
        let cap = self.delay(failures);
        // uuid's v4 draws from the OS's generator; 64 bits of it are plenty here.
        let unit = (uuid::Uuid::new_v4().as_u64_pair().0 >> 11) as f64 / (1u64 << 53) as f64;
        cap.mul_f64(unit)
    }
}

/// Checks the settings every worker builder has; `Err(Error::Config)` names the first problem.
pub(crate) fn check_common(
    batch_size: usize,
    poll_interval: Duration,
    max_attempts: u32,
    backoff: Backoff,
) -> Result<()> {
    let problem = if batch_size == 0 || batch_size > 100_000 {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Relays and consumers that failed together (a broker or database outage) must not retry
    /// in lockstep: each wait is drawn at random up to the exponential cap (full jitter).
    #[test]
    fn backoff_is_jittered_up_to_its_exponential_cap() {
        let backoff = Backoff {
            first: Duration::from_millis(100),
            max: Duration::from_secs(10),
        };
        for (attempt, cap) in [(1, 100), (3, 400), (8, 10_000), (u32::MAX, 10_000)] {
            let cap = Duration::from_millis(cap);
            let delays: Vec<Duration> = (0..1000).map(|_| backoff.jittered(attempt)).collect();
            let (min, max) = (delays.iter().min().unwrap(), delays.iter().max().unwrap());
            assert!(*max <= cap, "attempt {attempt}: {max:?} > {cap:?}");
            // 1,000 uniform draws: all above a quarter of the cap, or all below three quarters,
            // has a chance of 0.75^1000.
            assert!(
                *min < cap / 4 && *max > cap * 3 / 4,
                "attempt {attempt}: {min:?}..{max:?}"
            );
        }
    }
}
