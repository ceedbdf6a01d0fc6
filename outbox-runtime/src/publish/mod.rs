//! Publishing claimed outbox rows to a broker, whichever it is: the records' order per key
//! ([`order`]), the CloudEvents attributes ([`cloudevents`]), and the seam every broker
//! implements ([`transport`]). The relay and the operator's replay publish through it; the
//! brokers' folders build on it and nothing here names a broker.

pub(crate) mod cloudevents;
pub(crate) mod order;
pub(crate) mod transport;

pub use cloudevents::CloudEvents;
pub(crate) use order::{Class, Options, Outcome, PerKey, Sender};
pub(crate) use transport::{Boxed, Transport};
