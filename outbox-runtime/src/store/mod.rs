//! The SQL of each subsystem, on PostgreSQL: what the relay reads and writes of the outbox
//! ([`relay`]), and the row it claims and a replay reads ([`record`]); the JetStream
//! consumers' leases ([`lease`]). The modules above it (the relay, the consumers, the
//! operator's tools) call these functions and name no table layout of their own here.

#[cfg(feature = "_broker")]
#[cfg_attr(not(feature = "nats"), allow(dead_code))] // the fence only: no leases on Kafka
pub(crate) mod lease;
#[cfg_attr(not(feature = "_broker"), allow(dead_code, unused_imports))]
pub(crate) mod record;
#[cfg_attr(not(feature = "_broker"), allow(dead_code, unused_imports))]
pub(crate) mod relay;
