//! Parsing of the `#[outbox(...)]` helper attribute. Every key the macro knows is listed here.

use proc_macro2::Span;
use syn::meta::ParseNestedMeta;
use syn::spanned::Spanned as _;
use syn::{Attribute, LitStr, Path, Token};

use crate::ctxt::Ctxt;

pub const OUTBOX: &str = "outbox";

pub const TOPIC: &str = "topic";
pub const AGGREGATE_TYPE: &str = "aggregate_type";
pub const EVENT_TYPE: &str = "event_type";
pub const CRATE: &str = "crate";
pub const VERSION: &str = "version";
/// Keys accepted in `#[outbox(...)]` on the struct.
pub const STRUCT_KEYS: &[&str] = &[TOPIC, AGGREGATE_TYPE, EVENT_TYPE, VERSION, CRATE];

pub const AGGREGATE_ID: &str = "aggregate_id";
pub const KEY: &str = "key";
pub const EVENT_ID: &str = "event_id";
/// Keys accepted in `#[outbox(...)]` on a field.
pub const FIELD_KEYS: &[&str] = &[AGGREGATE_ID, KEY, EVENT_ID];

/// `#[outbox(...)]` on the struct.
#[derive(Default)]
pub struct StructAttrs {
    /// Span of the first `#[outbox]` attribute on the struct, if there is one.
    pub attr_span: Option<Span>,
    pub topic: Option<LitStr>,
    pub aggregate_type: Option<LitStr>,
    pub event_type: Option<LitStr>,
    pub krate: Option<Path>,
    /// `version = N`: the payload's schema version, at least 1.
    pub version: Option<u32>,
    /// Keys that were given with an invalid value (already reported).
    pub invalid: Vec<&'static str>,
}

/// `#[outbox(...)]` on a field: each flag holds the span of the key that set it.
#[derive(Default)]
pub struct FieldAttrs {
    pub aggregate_id: Option<Span>,
    pub key: Option<Span>,
    pub event_id: Option<Span>,
}

fn key_list(keys: &[&str]) -> String {
    keys.iter()
        .map(|k| format!("`{k}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn key_name(meta: &ParseNestedMeta) -> String {
    let path = &meta.path;
    path.get_ident()
        .map(ToString::to_string)
        .unwrap_or_else(|| quote::quote!(#path).to_string().replace(' ', ""))
}

/// Reports an unknown key and skips its value so that parsing goes on with the next key.
fn unknown_key(
    cx: &mut Ctxt,
    meta: &ParseNestedMeta,
    valid: &[&str],
    other_place: (&[&str], &str),
) -> syn::Result<()> {
    let name = key_name(meta);
    let mut msg = format!(
        "unknown outbox attribute key `{name}`; expected one of: {}",
        key_list(valid)
    );
    let (other_keys, other_where) = other_place;
    if other_keys.contains(&name.as_str()) {
        msg.push_str(&format!(" (`{name}` belongs on {other_where})"));
    }
    cx.error_spanned_by(&meta.path, msg);
    skip_value(meta)
}

fn skip_value(meta: &ParseNestedMeta) -> syn::Result<()> {
    if meta.input.peek(Token![=]) {
        meta.value()?.parse::<syn::Expr>()?;
    } else if meta.input.peek(syn::token::Paren) {
        let _ = meta.parse_nested_meta(|inner| skip_value(&inner));
    }
    Ok(())
}

fn set_once<T>(cx: &mut Ctxt, slot: &mut Option<T>, meta: &ParseNestedMeta, name: &str, value: T) {
    if slot.is_some() {
        cx.error_spanned_by(
            &meta.path,
            format!("duplicate outbox attribute key `{name}`"),
        );
    } else {
        *slot = Some(value);
    }
}

fn string_value(meta: &ParseNestedMeta, name: &str) -> syn::Result<LitStr> {
    let value = meta
        .value()
        .map_err(|_| syn::Error::new_spanned(&meta.path, format!("expected `{name} = \"...\"`")))?;
    let expr: syn::Expr = value.parse()?;
    match expr {
        syn::Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Str(s),
            ..
        }) => Ok(s),
        other => Err(syn::Error::new_spanned(
            other,
            format!("expected a string literal: `{name} = \"...\"`"),
        )),
    }
}

/// `version = N`: an integer literal from 1 to `u32::MAX`, unsuffixed or `u32`.
fn version_value(meta: &ParseNestedMeta) -> syn::Result<u32> {
    let value = meta
        .value()
        .map_err(|_| syn::Error::new_spanned(&meta.path, "expected `version = 2`"))?;
    version_literal(&value.parse()?, VERSION)
}

/// A schema version given to `key`: an integer literal from 1 to `u32::MAX`, unsuffixed or
/// `u32`. Shared with `#[inbox_handler(versions = [...])]`.
pub fn version_literal(expr: &syn::Expr, key: &str) -> syn::Result<u32> {
    let syn::Expr::Lit(syn::ExprLit {
        lit: syn::Lit::Int(int),
        ..
    }) = expr
    else {
        return Err(syn::Error::new_spanned(
            expr,
            format!("`{key}`: expected a schema version, a positive integer such as `2`"),
        ));
    };
    if !matches!(int.suffix(), "" | "u32") {
        return Err(syn::Error::new_spanned(
            int,
            format!(
                "`{key}`: a schema version is a `u32`; write `{}`",
                int.base10_digits()
            ),
        ));
    }
    match int.base10_parse::<u32>() {
        Ok(0) => Err(syn::Error::new_spanned(
            int,
            format!(
                "`{key}`: schema versions start at 1 (the version of an event without `version`)"
            ),
        )),
        Ok(v) => Ok(v),
        Err(_) => Err(syn::Error::new_spanned(
            int,
            format!(
                "`{key}`: a schema version must fit in a `u32` (at most {})",
                u32::MAX
            ),
        )),
    }
}

fn is_outbox(attr: &Attribute) -> bool {
    attr.path().is_ident(OUTBOX)
}

pub fn parse_struct_attrs(cx: &mut Ctxt, attrs: &[Attribute]) -> StructAttrs {
    let mut out = StructAttrs::default();
    for attr in attrs.iter().filter(|a| is_outbox(a)) {
        out.attr_span.get_or_insert(attr.path().span());
        let result = attr.parse_nested_meta(|meta| {
            let name = key_name(&meta);
            match name.as_str() {
                TOPIC | AGGREGATE_TYPE | EVENT_TYPE => {
                    let (key, slot) = match name.as_str() {
                        TOPIC => (TOPIC, &mut out.topic),
                        AGGREGATE_TYPE => (AGGREGATE_TYPE, &mut out.aggregate_type),
                        _ => (EVENT_TYPE, &mut out.event_type),
                    };
                    match string_value(&meta, key) {
                        Ok(lit) => set_once(cx, slot, &meta, key, lit),
                        Err(e) => {
                            cx.push(e);
                            out.invalid.push(key);
                            return skip_value(&meta);
                        }
                    }
                }
                VERSION => match version_value(&meta) {
                    Ok(v) => set_once(cx, &mut out.version, &meta, VERSION, v),
                    Err(e) => {
                        cx.push(e);
                        return skip_value(&meta);
                    }
                },
                CRATE => match string_value(&meta, CRATE).and_then(|lit| lit.parse::<Path>()) {
                    Ok(path) => set_once(cx, &mut out.krate, &meta, CRATE, path),
                    Err(e) => cx.push(e),
                },
                _ => return unknown_key(cx, &meta, STRUCT_KEYS, (FIELD_KEYS, "a field")),
            }
            Ok(())
        });
        if let Err(e) = result {
            cx.push(e);
        }
    }
    out
}

pub fn parse_field_attrs(cx: &mut Ctxt, attrs: &[Attribute]) -> FieldAttrs {
    let mut out = FieldAttrs::default();
    for attr in attrs.iter().filter(|a| is_outbox(a)) {
        let result = attr.parse_nested_meta(|meta| {
            let name = key_name(&meta);
            let slot = match name.as_str() {
                AGGREGATE_ID => &mut out.aggregate_id,
                KEY => &mut out.key,
                EVENT_ID => &mut out.event_id,
                _ => return unknown_key(cx, &meta, FIELD_KEYS, (STRUCT_KEYS, "the struct")),
            };
            if !meta.input.is_empty() && !meta.input.peek(Token![,]) {
                cx.error_spanned_by(
                    &meta.path,
                    format!("`{name}` takes no value: write `#[outbox({name})]`"),
                );
                skip_value(&meta)?;
            }
            if slot.is_some() {
                cx.error_spanned_by(
                    &meta.path,
                    format!("duplicate outbox attribute key `{name}`"),
                );
            } else {
                *slot = meta.path.get_ident().map(|i| i.span());
            }
            Ok(())
        });
        if let Err(e) = result {
            cx.push(e);
        }
    }
    out
}
