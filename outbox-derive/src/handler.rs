//! `#[inbox_handler]`: checks the signature of an async handler function and turns it into a
//! unit struct that implements `outbox_runtime::inbox::Handler`.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};
use syn::spanned::Spanned as _;
use syn::{FnArg, GenericArgument, ItemFn, LitStr, Path, PathArguments, ReturnType, Type};

use crate::ctxt::Ctxt;

/// `#[inbox_handler(name = "...", versions = [1, 2], crate = "...")]`.
struct Args {
    name: Option<LitStr>,
    /// The schema versions it accepts, with the list's span.
    versions: Option<(Vec<u32>, proc_macro2::Span)>,
    krate: Option<Path>,
}

/// `versions = [1, 2]`: distinct schema versions, at least one.
fn parse_versions(
    cx: &mut Ctxt,
    meta: &syn::meta::ParseNestedMeta,
) -> syn::Result<(Vec<u32>, proc_macro2::Span)> {
    let expr: syn::Expr = meta.value()?.parse()?;
    let syn::Expr::Array(array) = &expr else {
        return Err(syn::Error::new_spanned(
            expr,
            "expected a list of schema versions: `versions = [1, 2]`",
        ));
    };
    if array.elems.is_empty() {
        cx.error_spanned_by(array, "`versions` must list at least one schema version");
    }
    let mut versions = Vec::new();
    for elem in &array.elems {
        match crate::attr::version_literal(elem, "versions") {
            Ok(v) if versions.contains(&v) => {
                cx.error_spanned_by(elem, format!("schema version {v} is listed twice"));
            }
            Ok(v) => versions.push(v),
            Err(e) => cx.push(e),
        }
    }
    Ok((versions, array.span()))
}

fn parse_args(cx: &mut Ctxt, args: TokenStream) -> Args {
    let mut out = Args {
        name: None,
        versions: None,
        krate: None,
    };
    let mut errors = Ctxt::default();
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("name") {
            out.name = Some(meta.value()?.parse()?);
        } else if meta.path.is_ident("versions") {
            out.versions = Some(parse_versions(&mut errors, &meta)?);
        } else if meta.path.is_ident("crate") {
            out.krate = Some(meta.value()?.parse::<LitStr>()?.parse()?);
        } else {
            return Err(meta.error(
                "unknown inbox_handler argument; expected one of: `name`, `versions`, `crate`",
            ));
        }
        Ok(())
    });
    if let Err(e) = syn::parse::Parser::parse2(parser, args) {
        cx.push(e);
    }
    if let Err(e) = errors.check() {
        cx.push(e);
    }
    out
}

/// The last segment of a type's path, if it is a plain path.
fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ungrouped(ty) {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        _ => None,
    }
}

/// `ty` without the invisible groups (and parentheses) around it: a type given to a
/// `macro_rules!` as a `ty` fragment reaches the attribute wrapped in one.
fn ungrouped(ty: &Type) -> &Type {
    match ty {
        Type::Group(g) => ungrouped(&g.elem),
        Type::Paren(p) => ungrouped(&p.elem),
        _ => ty,
    }
}

/// [`ungrouped`], to change the type.
fn ungrouped_mut(ty: &mut Type) -> &mut Type {
    match ty {
        Type::Group(g) => ungrouped_mut(&mut g.elem),
        Type::Paren(p) => ungrouped_mut(&mut p.elem),
        _ => ty,
    }
}

/// The database whose connection a handler takes.
#[derive(Clone, Copy)]
enum Database {
    Postgres,
    MySql,
}

/// The database of `&mut PgConnection` or `&mut MySqlConnection`; `None` for any other type.
fn conn_database(ty: &Type) -> Option<Database> {
    match ungrouped(ty) {
        Type::Reference(r) if r.mutability.is_some() => {
            let segment = last_segment(&r.elem)?;
            if segment.ident == "PgConnection" {
                Some(Database::Postgres)
            } else if segment.ident == "MySqlConnection" {
                Some(Database::MySql)
            } else {
                None
            }
        }
        _ => None,
    }
}

fn is_handler_result(ty: &Type) -> bool {
    let Some(seg) = last_segment(ty) else {
        return false;
    };
    if seg.ident != "Result" {
        return false;
    }
    let PathArguments::AngleBracketed(args) = &seg.arguments else {
        return false;
    };
    let args: Vec<_> = args.args.iter().collect();
    match args.as_slice() {
        [GenericArgument::Type(unit), GenericArgument::Type(err)] => {
            matches!(ungrouped(unit), Type::Tuple(unit) if unit.elems.is_empty())
                && last_segment(err).is_some_and(|s| s.ident == "HandlerError")
        }
        _ => false,
    }
}

const SIGNATURE: &str = "expected `async fn name(event: Event, tx: &mut sqlx::PgConnection) -> \
     Result<(), HandlerError>`, optionally followed by `state: &AppState` and \
     `meta: &MessageMeta`";

/// What a parameter after the connection asks for.
enum Extra<'a> {
    /// The consumer's state, of this type.
    State(&'a Type),
    /// The message's metadata.
    Meta,
}

/// Whether `ty` (behind the reference) is the metadata type.
fn is_meta(ty: &Type) -> bool {
    last_segment(ty).is_some_and(|s| s.ident == "MessageMeta")
}

/// Reads a parameter after the connection: `&T` (state) or `&MessageMeta` (metadata).
fn extra<'a>(cx: &mut Ctxt, param: &'a FnArg) -> Option<Extra<'a>> {
    let ty = match param {
        FnArg::Receiver(r) => {
            cx.error_spanned_by(r, "an inbox handler is a free function, not a method");
            return None;
        }
        FnArg::Typed(t) => ungrouped(&t.ty),
    };
    match ty {
        Type::Reference(r) if r.mutability.is_none() => Some(if is_meta(&r.elem) {
            Extra::Meta
        } else {
            Extra::State(&r.elem)
        }),
        Type::Reference(r) => {
            let what = if is_meta(&r.elem) {
                "the message's metadata is taken as `&MessageMeta`, not `&mut`"
            } else {
                "an inbox handler's state is shared by every handler and processor: take it as \
                 `&T`, not `&mut T` (put what changes behind a lock)"
            };
            cx.error_spanned_by(ty, what);
            None
        }
        _ if is_meta(ty) => {
            cx.error_spanned_by(
                ty,
                "take the message's metadata by reference: `&MessageMeta`",
            );
            None
        }
        _ => {
            cx.error_spanned_by(
                ty,
                "a parameter after the connection is the consumer's state, `&T` (set with \
                 `Consumer::builder(..).state(T)`), or the message's metadata, `&MessageMeta`: \
                 take it by reference",
            );
            None
        }
    }
}

pub fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut cx = Ctxt::default();
    let args = parse_args(&mut cx, args);
    let func: ItemFn = match syn::parse2(item) {
        Ok(f) => f,
        Err(e) => return e.into_compile_error(),
    };
    let sig = &func.sig;
    if sig.asyncness.is_none() {
        cx.error_at(
            sig.fn_token.span,
            format!("an inbox handler must be `async`; {SIGNATURE}"),
        );
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        cx.error_spanned_by(&sig.generics, "an inbox handler cannot be generic");
    }
    let inputs: Vec<&FnArg> = sig.inputs.iter().collect();
    let mut event_ty = None;
    let mut database = Database::Postgres;
    // The arguments after the connection, in the function's order.
    let mut extras: Vec<Extra<'_>> = Vec::new();
    match inputs.as_slice() {
        [FnArg::Receiver(r), ..] | [_, FnArg::Receiver(r), ..] => {
            cx.error_spanned_by(r, "an inbox handler is a free function, not a method");
        }
        [FnArg::Typed(event), FnArg::Typed(conn), rest @ ..] if rest.len() <= 2 => {
            event_ty = Some(&*event.ty);
            if let Type::Reference(r) = ungrouped(&event.ty) {
                cx.error_spanned_by(
                    r,
                    "an inbox handler takes its event by value (it is deserialized for it)",
                );
            }
            match conn_database(&conn.ty) {
                Some(db) => database = db,
                None => cx.error_spanned_by(
                    &conn.ty,
                    "the second parameter of an inbox handler must be `&mut sqlx::PgConnection` \
                     or `&mut sqlx::MySqlConnection` (the transaction the handler's writes join)",
                ),
            }
            for param in rest {
                let Some(extra) = extra(&mut cx, param) else {
                    continue;
                };
                let repeated = extras.iter().any(|e| {
                    matches!(
                        (e, &extra),
                        (Extra::State(_), Extra::State(_)) | (Extra::Meta, Extra::Meta)
                    )
                });
                if repeated {
                    let what = match extra {
                        Extra::State(_) => {
                            "an inbox handler takes at most one state parameter: a consumer has \
                             one state (make it a struct of the parts)"
                        }
                        Extra::Meta => "the message's metadata is already a parameter",
                    };
                    cx.error_spanned_by(param, what);
                } else {
                    extras.push(extra);
                }
            }
        }
        _ => cx.error_at(
            if inputs.is_empty() {
                sig.paren_token.span.join()
            } else {
                sig.inputs.span()
            },
            format!(
                "an inbox handler takes the event and the connection, then optionally the state \
                 and the metadata: two to four parameters, not {}; {SIGNATURE}",
                inputs.len()
            ),
        ),
    }
    match &sig.output {
        ReturnType::Type(_, ty) if is_handler_result(ty) => {}
        ReturnType::Type(_, ty) => cx.error_spanned_by(
            ty,
            "an inbox handler must return `Result<(), HandlerError>`",
        ),
        ReturnType::Default => cx.error_at(
            sig.paren_token.span.close(),
            "an inbox handler must return `Result<(), HandlerError>`",
        ),
    }
    if let Err(errors) = cx.check() {
        // The function itself still compiles, so that its callers and imports add no errors.
        let errors = errors.into_compile_error();
        return quote!(#errors #func);
    }
    let Some(event_ty) = event_ty else {
        return quote!();
    };

    let krate = args
        .krate
        .unwrap_or_else(|| syn::parse_quote!(::outbox_runtime));
    let ident = &sig.ident;
    let name = args.name.as_ref().map_or_else(
        || LitStr::new(&ident.to_string(), ident.span()),
        Clone::clone,
    );
    // An explicit name is the deduplication key as it stands, whatever the consumer group.
    let dedup_key = args.name.is_some().then(|| {
        quote! {
            fn dedup_key(&self, _group: &str) -> ::std::string::String {
                ::std::string::String::from(#name)
            }
        }
    });
    // Declared versions: the handler takes these as they are; the event's own must be one.
    let versions = args.versions.as_ref().map(|(versions, span)| {
        let message = format!(
            "`#[inbox_handler(versions = [...])]` must list the event's own schema version \
             (`{}::SCHEMA_VERSION`)",
            quote!(#event_ty).to_string().replace(' ', "")
        );
        let check = quote::quote_spanned! {*span=>
            const _: () = ::core::assert!(
                #(<#event_ty as #krate::OutboxEvent>::SCHEMA_VERSION == #versions)||*,
                #message
            );
        };
        quote! {
            fn accepts_version(&self, version: u32) -> bool {
                #check
                ::core::matches!(version, #(#versions)|*)
            }
        }
    });
    let state_ty = extras.iter().find_map(|e| match e {
        Extra::State(ty) => Some(*ty),
        Extra::Meta => None,
    });
    // A handler without state is a handler of every consumer's state.
    let (impl_generics, state) = match state_ty {
        Some(ty) => (quote!(), quote!(#ty)),
        None => (
            quote!(<__S: ::core::marker::Send + ::core::marker::Sync + 'static>),
            quote!(__S),
        ),
    };
    let args = extras.iter().map(|e| match e {
        Extra::State(_) => quote!(state),
        Extra::Meta => quote!(meta),
    });
    let (db, conn_ty) = match database {
        Database::Postgres => (quote!(), quote!(#krate::__private::PgConnection)),
        Database::MySql => (
            quote!(, #krate::__private::MySql),
            quote!(#krate::__private::MySqlConnection),
        ),
    };
    let vis = &func.vis;
    let attrs = &func.attrs;
    let mut call_sig = sig.clone();
    call_sig.ident = format_ident!("call");
    // `meta: &MessageMeta` reads as it should: its lifetime is the reference's.
    for param in &mut call_sig.inputs {
        if let FnArg::Typed(t) = param {
            if let Type::Reference(r) = ungrouped_mut(&mut t.ty) {
                if let Type::Path(p) = ungrouped_mut(&mut r.elem) {
                    if let Some(last) = p.path.segments.last_mut() {
                        if last.ident == "MessageMeta" && last.arguments.is_none() {
                            last.arguments = PathArguments::AngleBracketed(syn::parse_quote!(<'_>));
                        }
                    }
                }
            }
        }
    }
    let block = &func.block;
    quote! {
        #(#attrs)*
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, Default)]
        #vis struct #ident;

        impl #ident {
            /// The handler's name (`Handler::name`).
            #[allow(dead_code)]
            #vis const NAME: &'static str = #name;

            /// The handler's name (`Handler::name`), whatever the consumer's state.
            #[allow(dead_code)]
            #vis fn name(&self) -> &'static str {
                #name
            }

            /// Runs the handler's body directly (without deduplication or retries).
            #[allow(dead_code)]
            #vis #call_sig #block
        }

        #[doc(hidden)]
        const _: () = {
            #[automatically_derived]
            impl #impl_generics #krate::inbox::Handler<#state #db> for #ident {
                type Event = #event_ty;

                fn name(&self) -> &str {
                    #name
                }

                #dedup_key

                #versions

                #[allow(unused_variables)]
                fn handle<'a>(
                    &'a self,
                    event: #event_ty,
                    conn: &'a mut #conn_ty,
                    state: &'a #state,
                    meta: &'a #krate::inbox::MessageMeta<'a>,
                ) -> #krate::__private::BoxFuture<'a, ::core::result::Result<(), #krate::inbox::HandlerError>> {
                    ::std::boxed::Box::pin(#ident::call(event, conn #(, #args)*))
                }
            }
        };
    }
}
