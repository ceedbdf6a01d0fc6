//! A relay's settings: what its builder sets and checks, kept whole by the running relay.

use std::time::Duration;

use crate::admin::{HealthThresholds, Retention};
use crate::config::Backoff;
use crate::error::{Error, Result};
use crate::publish::{CloudEvents, Options, PerKey};

/// A relay's settings (see [`RelayBuilder`](super::RelayBuilder) for each), with its
/// defaults.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) batch_size: usize,
    pub(crate) poll_interval: Duration,
    pub(crate) publish_timeout: Duration,
    pub(crate) failover_timeout: Duration,
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
    pub(crate) hold_operator_errors: bool,
    pub(crate) per_key: PerKey,
    pub(crate) cloud_events: Option<CloudEvents>,
    pub(crate) health: HealthThresholds,
    pub(crate) health_interval: Duration,
    pub(crate) retention: Option<Retention>,
    pub(crate) claim_floor_interval: Duration,
    pub(crate) claim_floor_margin: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            batch_size: 500,
            poll_interval: Duration::from_millis(500),
            publish_timeout: Duration::from_secs(10),
            failover_timeout: Duration::from_secs(20),
            max_attempts: 5,
            backoff: Backoff {
                first: Duration::from_secs(1),
                max: Duration::from_secs(60),
            },
            hold_operator_errors: true,
            per_key: PerKey::Pipelined,
            cloud_events: None,
            health: HealthThresholds::default(),
            health_interval: Duration::from_secs(30),
            retention: None,
            claim_floor_interval: Duration::from_secs(10),
            claim_floor_margin: Duration::from_secs(5 * 60),
        }
    }
}

impl Settings {
    /// `Err(Error::Config)` names the first setting that cannot work.
    pub(crate) fn check(&self) -> Result<()> {
        let config_err = |msg: String| Err(Error::Config(msg));
        crate::config::check_common(
            self.batch_size,
            self.poll_interval,
            self.max_attempts,
            self.backoff,
        )?;
        if self.publish_timeout < Duration::from_millis(100) {
            return config_err(format!(
                "publish_timeout must be at least 100 ms, not {:?}",
                self.publish_timeout
            ));
        }
        if self.failover_timeout < self.publish_timeout + Duration::from_secs(1) {
            return config_err(format!(
                "failover_timeout ({:?}) must exceed publish_timeout ({:?}) by at least 1 s: a \
                 relay is silent that long while it waits for acknowledgements",
                self.failover_timeout, self.publish_timeout
            ));
        }
        if !self.health_interval.is_zero() && self.health_interval < Duration::from_secs(1) {
            return config_err(format!(
                "health_interval must be at least 1 s (or zero: no health checks), not {:?}",
                self.health_interval
            ));
        }
        if let Some(retention) = &self.retention {
            retention.check()?;
        }
        if let Some(ce) = &self.cloud_events {
            ce.check().map_err(Error::Config)?;
        }
        Ok(())
    }

    /// How a batch is published.
    pub(crate) fn publishing(&self) -> Options<'_> {
        Options {
            timeout: self.publish_timeout,
            per_key: self.per_key,
            cloud_events: self.cloud_events.as_ref(),
        }
    }

    /// `max_attempts` as the database's `attempts` column counts.
    pub(crate) fn max_attempts_i32(&self) -> i32 {
        self.max_attempts.min(i32::MAX as u32) as i32
    }
}
