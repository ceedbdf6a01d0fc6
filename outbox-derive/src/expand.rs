//! Code generation. Generated code names only `<crate>::__private::*` and `::core::*`.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned as _;
use syn::{DeriveInput, Path};

use crate::ast::{Field, Input};
use crate::ctxt::Ctxt;
use crate::valid::{self, Event};

pub fn derive(input: &DeriveInput) -> TokenStream {
    let mut cx = Ctxt::default();
    let model = Input::from_syn(&mut cx, input);
    let event = valid::validate(&mut cx, &model);
    match (cx.check(), event) {
        (Ok(()), Some(event)) => impl_event(&event),
        (Err(errors), _) => {
            let errors = errors.into_compile_error();
            let stub = stub_impl(&model);
            quote!(#errors #stub)
        }
        // `validate` only returns `None` after reporting an error.
        (Ok(()), None) => stub_impl(&model),
    }
}

/// Wraps generated items so that nothing leaks into the user's namespace.
fn dummy_const(items: TokenStream) -> TokenStream {
    quote! {
        #[doc(hidden)]
        #[allow(non_upper_case_globals, unused_attributes, unused_qualifications, clippy::all)]
        const _: () = {
            #items
        };
    }
}

fn field_string(krate: &Path, field: &Field) -> TokenStream {
    let member = &field.member;
    let ty = field.ty;
    quote_spanned! {ty.span()=>
        #krate::__private::display_field::<#ty>(&self.#member)
    }
}

/// What goes inside the impl, as tokens.
struct Body {
    topic: TokenStream,
    aggregate_type: TokenStream,
    event_type: TokenStream,
    version: u32,
    aggregate_id: TokenStream,
    partition_key: TokenStream,
    event_id: TokenStream,
    payload_json: TokenStream,
}

fn impl_block(model: &Input, krate: &Path, body: Body) -> TokenStream {
    let ident = model.ident;
    let (impl_generics, ty_generics, where_clause) = model.generics.split_for_impl();
    let Body {
        topic,
        aggregate_type,
        event_type,
        version,
        aggregate_id,
        partition_key,
        event_id,
        payload_json,
    } = body;
    dummy_const(quote! {
        #[automatically_derived]
        impl #impl_generics #krate::OutboxEvent for #ident #ty_generics #where_clause {
            const TOPIC: &'static str = #topic;
            const AGGREGATE_TYPE: &'static str = #aggregate_type;
            const EVENT_TYPE: &'static str = #event_type;
            const SCHEMA_VERSION: u32 = #version;

            #[inline]
            fn aggregate_id(&self) -> #krate::__private::String {
                #aggregate_id
            }

            #[inline]
            fn partition_key(&self) -> #krate::__private::String {
                #partition_key
            }

            #[inline]
            fn event_id(&self) -> ::core::option::Option<#krate::__private::Uuid> {
                #event_id
            }

            #[inline]
            fn payload_json(
                &self,
            ) -> ::core::result::Result<#krate::__private::String, #krate::__private::JsonError> {
                #payload_json
            }
        }
    })
}

fn impl_event(event: &Event) -> TokenStream {
    let krate = &event.krate;
    let ident = event.input.ident;
    let event_id = match event.event_id {
        Some(field) => {
            let member = &field.member;
            let ty = field.ty;
            quote_spanned! {ty.span()=>
                ::core::option::Option::Some(#krate::__private::event_id_field::<#ty>(&self.#member))
            }
        }
        None => quote!(::core::option::Option::None),
    };
    let (topic, aggregate_type, event_type) =
        (&event.topic, &event.aggregate_type, &event.event_type);
    let body = Body {
        topic: quote!(#topic),
        aggregate_type: quote!(#aggregate_type),
        event_type: quote!(#event_type),
        version: event.version,
        aggregate_id: field_string(krate, event.aggregate_id),
        partition_key: field_string(krate, event.key),
        event_id,
        // Spanned at the struct's name: that is where a missing `Serialize` is reported.
        payload_json: quote_spanned! {ident.span()=>
            #krate::__private::to_json::<Self>(self)
        },
    };
    impl_block(event.input, krate, body)
}

/// An impl that never runs, emitted beside the errors so that uses of the type elsewhere do not
/// add a cascade of "not an outbox event" errors to the real one.
fn stub_impl(model: &Input) -> TokenStream {
    let unreachable = quote!(::core::unreachable!());
    let body = Body {
        topic: quote!(""),
        aggregate_type: quote!(""),
        event_type: quote!(""),
        version: 1,
        aggregate_id: unreachable.clone(),
        partition_key: unreachable.clone(),
        event_id: unreachable.clone(),
        payload_json: unreachable,
    };
    impl_block(model, &model.crate_path(), body)
}
