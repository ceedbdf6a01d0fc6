//! The broker a builder is given, whichever it is: a relay, a consumer and a replay are each
//! built with one [`BrokerSettings`] value, which turns into that broker's transport (the
//! relay's [`Transport`]; a consumer's source, through the maker its builder method stored
//! beside it). Each broker's folder implements it and adds its builder methods (`brokers`,
//! `jetstream`, ...); nothing here names a broker, so the builders never import a broker's
//! folder (which builds on them). Adding a broker: a folder with its settings value and its
//! builder methods.

use std::any::Any;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::publish::Transport;

/// A broker's settings, as given to a builder.
pub(crate) trait BrokerSettings: Erased + Send + Sync + std::fmt::Debug {
    /// How a message names it: "Kafka brokers", "JetStream".
    fn name(&self) -> &'static str;

    /// Where it comes in a list of several (the order in which an error names them).
    fn rank(&self) -> u8;

    /// Checks its own settings; `Err(Error::Config)` names the first that cannot work.
    fn check(&self) -> Result<()>;

    /// Whether a consumer group reads each topic under a lease (a table of the consumer's
    /// database), not under the broker's own assignment: JetStream.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    fn reads_under_lease(&self) -> bool {
        false
    }

    /// The consumer group its settings name (Kafka's `group.id`), if any.
    fn group(&self) -> Option<&str> {
        None
    }

    /// A relay's (or replay's) transport to it: `timeout` bounds each wait for the broker,
    /// `failover` is the relay's failover timeout.
    fn transport(&self, timeout: Duration, failover: Duration) -> Result<Box<dyn Transport>>;
}

/// What every broker's settings have without writing it: a copy (builders are `Clone`), and
/// themselves as `Any`, for their builder methods to find them.
pub(crate) trait Erased: Any {
    fn clone_box(&self) -> Box<dyn BrokerSettings>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl<T: BrokerSettings + Clone> Erased for T {
    fn clone_box(&self) -> Box<dyn BrokerSettings> {
        Box::new(self.clone())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// The brokers a builder was given, each with what its builder method stored beside it (`M`:
/// a consumer's source maker; nothing for a relay): `build` takes exactly one.
#[derive(Debug)]
pub(crate) struct Brokers<M = ()>(Vec<(Box<dyn BrokerSettings>, M)>);

impl<M> Default for Brokers<M> {
    fn default() -> Self {
        Brokers(Vec::new())
    }
}

impl<M: Clone> Clone for Brokers<M> {
    fn clone(&self) -> Self {
        Brokers(
            self.0
                .iter()
                .map(|(b, m)| (b.clone_box(), m.clone()))
                .collect(),
        )
    }
}

impl<M> Brokers<M> {
    /// The settings of broker `T` given so far (created with its defaults on first use), for
    /// a broker whose builder methods add to its settings one by one (Kafka's).
    #[allow(dead_code)] // not every build has such a broker
    pub(crate) fn get_or_default<T: BrokerSettings + Default>(&mut self, maker: M) -> &mut T {
        let i = match self.0.iter().position(|(b, _)| b.as_any().is::<T>()) {
            Some(i) => i,
            None => {
                self.0.push((Box::new(T::default()), maker));
                self.0.len() - 1
            }
        };
        self.0[i]
            .0
            .as_any_mut()
            .downcast_mut::<T>()
            .expect("found as T")
    }

    /// Sets broker `T`'s settings, in place of those given before, for a broker whose builder
    /// method takes them whole (JetStream's).
    #[allow(dead_code)] // not every build has such a broker
    pub(crate) fn set<T: BrokerSettings>(&mut self, settings: T, maker: M) {
        self.0.retain(|(b, _)| !b.as_any().is::<T>());
        self.0.push((Box::new(settings), maker));
    }

    /// The one broker given; `role` says what a worker does with it ("a relay publishes to
    /// one"). The error names what to call.
    pub(crate) fn one(&self, role: &str) -> Result<(&dyn BrokerSettings, &M)> {
        match self.0.as_slice() {
            [(broker, maker)] => Ok((&**broker, maker)),
            [] => Err(Error::Config(NONE.into())),
            several => {
                let mut names: Vec<_> = several.iter().map(|(b, _)| (b.rank(), b.name())).collect();
                names.sort_unstable();
                let names: Vec<&str> = names.into_iter().map(|(_, name)| name).collect();
                Err(Error::Config(format!(
                    "both {} are set: {role}",
                    names.join(" and ")
                )))
            }
        }
    }
}

/// What `build` says when no broker was given.
#[cfg(feature = "kafka")]
const NONE: &str = "no Kafka brokers: call `brokers(...)` or set bootstrap.servers";
#[cfg(not(feature = "kafka"))]
const NONE: &str =
    "no broker: call `jetstream(...)` or `rabbitmq(...)` (this build has no Kafka: feature `kafka`)";
