//! Procedural macros for `outbox-runtime`. Use them through `outbox_runtime`, which re-exports
//! them; this crate only parses, validates and expands, and never does I/O.
//!
//! Each stage has its own (private) module: `attr` parses `#[outbox(...)]` attributes, `ast`
//! reads the input into a model, `valid` checks it and `expand` generates the impl. `ctxt`
//! collects every error so that all of them are reported at once.

#![warn(missing_docs)]

mod ast;
mod attr;
mod ctxt;
mod expand;
#[cfg(test)]
mod expanded_example;
mod handler;
mod valid;

use proc_macro::TokenStream;
use syn::{parse_macro_input, DeriveInput};

/// Derives `outbox_runtime::OutboxEvent`. See the trait's documentation for the attributes.
#[proc_macro_derive(OutboxEvent, attributes(outbox))]
pub fn derive_outbox_event(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand::derive(&input).into()
}

/// Turns `async fn name(event: E, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError>`
/// into a handler value (a unit struct of the same name) to register on a consumer. After the
/// connection it may take `state: &T` (the consumer's state: the handler then implements
/// `Handler<T>` only) and `meta: &MessageMeta` (the message's metadata), in either order.
/// With `tx: &mut sqlx::MySqlConnection` it is a handler of consumers on MariaDB/MySQL
/// (`Handler<T, sqlx::MySql>`; the runtime's feature `mysql`).
/// `#[inbox_handler(name = "...")]` names it (its deduplication key as it stands). See
/// `outbox_runtime::inbox`.
#[proc_macro_attribute]
pub fn inbox_handler(args: TokenStream, item: TokenStream) -> TokenStream {
    handler::expand(args.into(), item.into()).into()
}
