//! The seam between the relay (and the operator's replay) and a broker: what a batch asks of
//! whichever broker the relay was built with.
//!
//! A trait object, not an enum of the brokers: the relay's loop, claims and marks, and replay,
//! never name a broker. Each broker's folder (`kafka/`, `nats/`) implements [`Transport`] and
//! hands one to the builder; an enum here would name every broker, and the brokers' folders,
//! which build on this module, would be named back by it. A batch makes one call through it:
//! the dynamic dispatch costs nothing beside the batch's round trips.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use super::order::{Options, Outcome};
use crate::store::record::Claimed;

/// A boxed future borrowed from the transport.
pub(crate) type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a relay needs of a broker.
pub(crate) trait Transport: Send + Sync + 'static {
    /// Sends the rows and waits for their acknowledgements (at most `options.timeout`): one
    /// outcome per row, in order, each key's order kept (see [`super::order::publish`]).
    fn publish<'a>(&'a self, rows: &'a [Claimed], options: Options<'a>) -> Boxed<'a, Vec<Outcome>>;

    /// Whether the broker answers within `within`; `Err` says what failed.
    fn ready(&self, within: Duration) -> Boxed<'_, Result<(), String>>;
}
