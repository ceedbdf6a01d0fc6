//! The `outbox` binary against real PostgreSQL and Kafka (the mock cluster): every command, its
//! effects checked in the database and on the broker, and its errors. One test binary, a module
//! per area; `support` holds what they share.

mod support;

mod cleanup;
mod console;
mod dev_broker;
mod errors;
mod mysql;
mod partitions;
mod poison;
mod rabbitmq;
mod relay;
mod replay;
mod status;
mod tls;
mod topics;
