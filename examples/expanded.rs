//! What `#[derive(OutboxEvent)]` generates, written out.
//!
//! ```sh
//! cargo run --example expanded
//! ```
//!
//! The event in the comment below is declared the usual way, with the derive. This file declares
//! the same struct without the derive and then spells out the code the derive generates for it
//! (outbox-derive's `expand::derive`, pretty-printed), so that `main` runs on the written-out
//! impl. What the derive generates:
//!
//! - one `impl OutboxEvent`, inside `const _: () = { ... };` so that nothing it needs leaks into
//!   your namespace;
//! - the topic, aggregate type and event type as constants, checked at compile time;
//! - `aggregate_id`, `partition_key` and `event_id` reading the marked fields (through helpers
//!   that name the field's type, so a wrong type is reported at the field);
//! - `payload_json`: the struct as JSON, through its `Serialize`.
//!
//! A test in outbox-derive checks that the code between `expansion:begin` and `expansion:end`
//! is exactly what the derive generates for the input between `derive-input:begin` and
//! `derive-input:end`, and that the struct below matches that input. When the derive's output
//! changes, `UPDATE_EXPANDED=1 cargo test -p outbox-derive` rewrites the generated part.

use std::error::Error;

use outbox_runtime::{OutboxEvent, OutboxRecord};
use uuid::Uuid;

// derive-input:begin
// #[derive(serde::Serialize, OutboxEvent)]
// #[outbox(topic = "order.events", aggregate_type = "Order", event_type = "OrderCreated")]
// struct OrderCreated {
//     #[outbox(aggregate_id)]
//     order_id: Uuid,
//     #[outbox(key)]
//     customer_id: String,
//     #[outbox(event_id)]
//     event_id: Uuid,
//     amount: i64,
// }
// derive-input:end

/// The event above, without the derive and its `#[outbox]` attributes.
#[derive(serde::Serialize)]
struct OrderCreated {
    order_id: Uuid,
    customer_id: String,
    event_id: Uuid,
    amount: i64,
}

/// The derive's output for the input above. Generated: do not edit by hand.
#[rustfmt::skip]
mod derived {
    use super::*;

    // expansion:begin
    #[doc(hidden)]
    #[allow(non_upper_case_globals, unused_attributes, unused_qualifications, clippy::all)]
    const _: () = {
        #[automatically_derived]
        impl ::outbox_runtime::OutboxEvent for OrderCreated {
            const TOPIC: &'static str = "order.events";
            const AGGREGATE_TYPE: &'static str = "Order";
            const EVENT_TYPE: &'static str = "OrderCreated";
            const SCHEMA_VERSION: u32 = 1u32;
            #[inline]
            fn aggregate_id(&self) -> ::outbox_runtime::__private::String {
                ::outbox_runtime::__private::display_field::<Uuid>(&self.order_id)
            }
            #[inline]
            fn partition_key(&self) -> ::outbox_runtime::__private::String {
                ::outbox_runtime::__private::display_field::<String>(&self.customer_id)
            }
            #[inline]
            fn event_id(&self) -> ::core::option::Option<::outbox_runtime::__private::Uuid> {
                ::core::option::Option::Some(
                    ::outbox_runtime::__private::event_id_field::<Uuid>(&self.event_id),
                )
            }
            #[inline]
            fn payload_json(
                &self,
            ) -> ::core::result::Result<
                ::outbox_runtime::__private::String,
                ::outbox_runtime::__private::JsonError,
            > {
                ::outbox_runtime::__private::to_json::<Self>(self)
            }
        }
    };
    // expansion:end
}

fn main() -> Result<(), Box<dyn Error>> {
    let event = OrderCreated {
        order_id: Uuid::from_u128(0x0190_a1b2_c3d4_7e5f_8a6b_1c2d_3e4f_5a6b),
        customer_id: "customer-42".to_owned(),
        event_id: Uuid::from_u128(0x0190_a1b2_c3d4_7000_8000_0000_0000_0001),
        amount: 1500,
    };
    println!("TOPIC            {}", OrderCreated::TOPIC);
    println!("AGGREGATE_TYPE   {}", OrderCreated::AGGREGATE_TYPE);
    println!("EVENT_TYPE       {}", OrderCreated::EVENT_TYPE);
    println!("aggregate_id()   {}", event.aggregate_id());
    println!("partition_key()  {}", event.partition_key());
    println!("event_id()       {:?}", event.event_id());
    println!("payload_json()   {}", event.payload_json()?);

    // What `emit` makes of it: the validated outbox row (no database needed to build it).
    let record = OutboxRecord::from_event(&event)?;
    println!(
        "outbox row: event_id={} topic={} aggregate={}/{} type={} key={} payload={}",
        record.event_id(),
        record.topic(),
        record.aggregate_type(),
        record.aggregate_id(),
        record.event_type(),
        record.partition_key(),
        record.payload(),
    );
    Ok(())
}
