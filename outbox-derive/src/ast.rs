//! The derive input read into a model: the struct, its attributes and its fields.

use syn::{Data, DeriveInput, Fields, Generics, Ident, Member, Path, Type};

use crate::attr::{self, FieldAttrs, StructAttrs};
use crate::ctxt::Ctxt;

pub struct Input<'a> {
    pub ident: &'a Ident,
    pub generics: &'a Generics,
    pub attrs: StructAttrs,
    /// The named fields; empty when the input is not a struct with named fields (already reported).
    pub fields: Vec<Field<'a>>,
    /// Whether field markers can be checked: false for an enum, union or tuple struct, which were
    /// already reported.
    pub fields_checkable: bool,
}

pub struct Field<'a> {
    pub member: Member,
    pub ty: &'a Type,
    pub attrs: FieldAttrs,
}

impl<'a> Input<'a> {
    /// The path generated code uses for the runtime crate: `#[outbox(crate = "...")]` or
    /// `::outbox_runtime`.
    pub fn crate_path(&self) -> Path {
        self.attrs
            .krate
            .clone()
            .unwrap_or_else(|| syn::parse_quote!(::outbox_runtime))
    }

    pub fn from_syn(cx: &mut Ctxt, input: &'a DeriveInput) -> Self {
        let attrs = attr::parse_struct_attrs(cx, &input.attrs);
        let fields = match &input.data {
            Data::Struct(data) => match &data.fields {
                Fields::Named(named) => named
                    .named
                    .iter()
                    .filter_map(|f| {
                        Some(Field {
                            member: Member::Named(f.ident.clone()?),
                            ty: &f.ty,
                            attrs: attr::parse_field_attrs(cx, &f.attrs),
                        })
                    })
                    .collect(),
                Fields::Unnamed(unnamed) => {
                    cx.error_spanned_by(
                        unnamed,
                        "`OutboxEvent` cannot be derived for a tuple struct; \
                         use a struct with named fields (they become the JSON payload's keys)",
                    );
                    Vec::new()
                }
                Fields::Unit => Vec::new(),
            },
            Data::Enum(data) => {
                cx.error_at(
                    data.enum_token.span,
                    "`OutboxEvent` cannot be derived for an enum; \
                     derive it on one struct per event type",
                );
                Vec::new()
            }
            Data::Union(data) => {
                cx.error_at(
                    data.union_token.span,
                    "`OutboxEvent` cannot be derived for a union; use a struct with named fields",
                );
                Vec::new()
            }
        };
        let fields_checkable = matches!(
            &input.data,
            Data::Struct(d) if !matches!(d.fields, Fields::Unnamed(_))
        );
        Input {
            fields_checkable,
            ident: &input.ident,
            generics: &input.generics,
            attrs,
            fields,
        }
    }
}
