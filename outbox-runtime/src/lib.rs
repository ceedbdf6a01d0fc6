#![doc = include_str!("lib.md")]
#![warn(
    missing_debug_implementations,
    missing_docs,
    rust_2018_idioms,
    unreachable_pub
)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// A build with a broker's machinery (`prometheus` turns it on) but no broker to use it.
#![cfg_attr(
    not(any(feature = "kafka", feature = "nats", feature = "rabbitmq")),
    allow(dead_code, unused_imports)
)]

pub mod admin;
#[cfg(feature = "_broker")]
mod broker;
#[cfg(feature = "_broker")]
mod config;
#[cfg(feature = "console")]
#[cfg_attr(docsrs, doc(cfg(feature = "console")))]
pub mod console;
mod error;
mod event;
pub mod inbox;
#[cfg(feature = "kafka")]
mod kafka;
pub mod migrate;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "prometheus")]
mod prometheus;
#[cfg(feature = "_broker")]
mod publish;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;
pub mod relay;
mod sqlstate;
mod store;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
pub mod trace;
mod uow;

/// The NATS client this crate publishes with ([`nats::JetStream`] takes its `Client`): use
/// this one, or the same version of `async-nats`.
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use async_nats;
#[cfg(feature = "_broker")]
pub use error::PublishError;
pub use error::{error_chain, Error, Result};
pub use event::{is_reserved_header, IntoRecord, OutboxEvent, OutboxRecord, SCHEMA_VERSION_HEADER};
pub use migrate::{migrate, migrate_on};
#[cfg(feature = "prometheus")]
#[cfg_attr(docsrs, doc(cfg(feature = "prometheus")))]
pub use prometheus::{serve_prometheus, serve_prometheus_for_relay};
pub use uow::{emit, emit_all, emit_with, EmitDatabase, EmitFuture, Uow};

/// `#[derive(OutboxEvent)]`: see the [`OutboxEvent`](trait@OutboxEvent) trait for its attributes.
#[cfg(feature = "derive")]
#[cfg_attr(docsrs, doc(cfg(feature = "derive")))]
pub use outbox_derive::OutboxEvent;

/// `#[inbox_handler]`: see the [`inbox`] module.
#[cfg(feature = "derive")]
#[cfg_attr(docsrs, doc(cfg(feature = "derive")))]
pub use outbox_derive::inbox_handler;

/// Used by the code that `#[derive(OutboxEvent)]` generates. Not public API.
#[doc(hidden)]
pub mod __private {
    use std::fmt::Display;

    pub use serde_json::Error as JsonError;
    pub use sqlx::PgConnection;
    #[cfg(feature = "mysql")]
    pub use sqlx::{MySql, MySqlConnection};

    pub use crate::inbox::BoxFuture;

    pub use std::string::String;
    pub use uuid::Uuid;

    /// A partition key or aggregate id field: any `Display` type.
    #[inline]
    pub fn display_field<T: Display + ?Sized>(value: &T) -> String {
        value.to_string()
    }

    /// The payload of a derived event.
    #[inline]
    pub fn to_json<T: serde::Serialize + ?Sized>(event: &T) -> Result<String, serde_json::Error> {
        serde_json::to_string(event)
    }

    /// An `#[outbox(event_id)]` field.
    #[inline]
    pub fn event_id_field<T: EventIdField + ?Sized>(value: &T) -> Uuid {
        value.event_id()
    }

    #[diagnostic::on_unimplemented(
        message = "an `#[outbox(event_id)]` field must be a `uuid::Uuid`, not `{Self}`",
        label = "not a `uuid::Uuid`"
    )]
    pub trait EventIdField {
        fn event_id(&self) -> Uuid;
    }

    impl EventIdField for Uuid {
        #[inline]
        fn event_id(&self) -> Uuid {
            *self
        }
    }
}
