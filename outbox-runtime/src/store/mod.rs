//! The SQL of each subsystem, on PostgreSQL (and which database a relay or replay reads:
//! [`database`]): what the relay reads and writes of the outbox
//! ([`relay`]), and the row it claims and a replay reads ([`record`]); the consumers':
//! dedup mode's `processed_event` rows ([`dedup`]), inbox mode's `inbox_event` rows
//! ([`inbox`]), the JetStream consumers' leases ([`lease`]), the source locks a dedup batch or
//! an inbox receipt takes ([`source_lock`]), and the shards relays and inbox processors hold
//! ([`shards`]). The modules above it (the relay, the consumers, the operator's tools) call
//! these functions and name no table layout of their own here.
//! MariaDB/MySQL's are the `_mysql` files (a dedup batch's transactions, SQL and all, are
//! `inbox/batch_mysql.rs`; the relay's `mysql/relay.rs`), and `literal_mysql` writes values
//! into their multi-statement round trips.

#[cfg(all(feature = "mysql", any(feature = "kafka", feature = "rabbitmq")))]
pub(crate) mod consumer_mysql;
#[cfg(feature = "_broker")]
pub(crate) mod database;
#[cfg(feature = "_broker")]
pub(crate) mod dedup;
#[cfg_attr(not(feature = "_broker"), allow(dead_code, unused_imports))]
pub(crate) mod inbox;
#[cfg(feature = "_broker")]
pub(crate) mod lease;
#[cfg(all(feature = "_broker", feature = "mysql"))]
#[allow(dead_code)] // by the brokers that read under a lease (JetStream)
pub(crate) mod lease_mysql;
#[cfg(feature = "mysql")]
pub(crate) mod literal_mysql;
#[cfg_attr(not(feature = "_broker"), allow(dead_code, unused_imports))]
pub(crate) mod record;
#[cfg_attr(not(feature = "_broker"), allow(dead_code, unused_imports))]
pub(crate) mod relay;
#[cfg_attr(not(feature = "_broker"), allow(dead_code, unused_imports))]
pub(crate) mod shards;
#[cfg_attr(not(feature = "_broker"), allow(dead_code, unused_imports))]
pub(crate) mod source_lock;
