//! Runnable examples (see the README):
//!
//! - `quickstart/`: an orders HTTP API and a payments service, each with its own database and
//!   outbox, talking through Kafka (`cargo run --example quickstart`);
//! - `expanded.rs`: what `#[derive(OutboxEvent)]` generates, written out
//!   (`cargo run --example expanded`).
//!
//! `tests/quickstart.rs` runs both as a user would.
