//! The SQL of each subsystem, on PostgreSQL: what the relay reads and writes of the outbox
//! ([`relay`]), and the row it claims and a replay reads ([`record`]). The modules above it (the relay, the operator's tools) call these functions
//! and name no table layout of their own here.

#[cfg_attr(not(feature = "_broker"), allow(dead_code, unused_imports))]
pub(crate) mod record;
#[cfg_attr(not(feature = "_broker"), allow(dead_code, unused_imports))]
pub(crate) mod relay;
