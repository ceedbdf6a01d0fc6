//! `#[inbox_handler]`: checks the signature of an async handler function and turns it into a
//! unit struct that implements `outbox_runtime::inbox::Handler`.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};
use syn::spanned::Spanned as _;
use syn::{FnArg, GenericArgument, ItemFn, LitStr, Path, PathArguments, ReturnType, Type};

use crate::ctxt::Ctxt;

/// `#[inbox_handler(name = "...", crate = "...")]`.
struct Args {
    name: Option<LitStr>,
    krate: Option<Path>,
}

fn parse_args(cx: &mut Ctxt, args: TokenStream) -> Args {
    let mut out = Args {
        name: None,
        krate: None,
    };
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("name") {
            out.name = Some(meta.value()?.parse()?);
        } else if meta.path.is_ident("crate") {
            out.krate = Some(meta.value()?.parse::<LitStr>()?.parse()?);
        } else {
            return Err(
                meta.error("unknown inbox_handler argument; expected one of: `name`, `crate`")
            );
        }
        Ok(())
    });
    if let Err(e) = syn::parse::Parser::parse2(parser, args) {
        cx.push(e);
    }
    out
}

/// The last segment of a type's path, if it is a plain path.
fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        _ => None,
    }
}

fn is_conn(ty: &Type) -> bool {
    match ty {
        Type::Reference(r) if r.mutability.is_some() => {
            last_segment(&r.elem).is_some_and(|s| s.ident == "PgConnection")
        }
        _ => false,
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
        [GenericArgument::Type(Type::Tuple(unit)), GenericArgument::Type(err)] => {
            unit.elems.is_empty() && last_segment(err).is_some_and(|s| s.ident == "HandlerError")
        }
        _ => false,
    }
}

const SIGNATURE: &str =
    "expected `async fn name(event: Event, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError>`";

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
    match inputs.as_slice() {
        [FnArg::Typed(event), FnArg::Typed(conn)] => {
            event_ty = Some(&*event.ty);
            if !is_conn(&conn.ty) {
                cx.error_spanned_by(
                    &conn.ty,
                    "the second parameter of an inbox handler must be `&mut sqlx::PgConnection` \
                     (the transaction the handler's writes join)",
                );
            }
        }
        [FnArg::Receiver(r), ..] | [_, FnArg::Receiver(r)] => {
            cx.error_spanned_by(r, "an inbox handler is a free function, not a method");
        }
        _ => cx.error_at(
            if inputs.is_empty() {
                sig.paren_token.span.join()
            } else {
                sig.inputs.span()
            },
            format!(
                "an inbox handler takes exactly two parameters, the event and the connection, \
                 not {}; {SIGNATURE}",
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
    let explicit_name = args.name.is_some();
    let name = args
        .name
        .unwrap_or_else(|| LitStr::new(&ident.to_string(), ident.span()));
    let vis = &func.vis;
    let attrs = &func.attrs;
    let mut call_sig = sig.clone();
    call_sig.ident = format_ident!("call");
    let block = &func.block;
    quote! {
        #(#attrs)*
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, Default)]
        #vis struct #ident;

        impl #ident {
            /// Runs the handler's body directly (without deduplication or retries).
            #[allow(dead_code)]
            #vis #call_sig #block
        }

        #[doc(hidden)]
        const _: () = {
            #[automatically_derived]
            impl #krate::inbox::Handler for #ident {
                type Event = #event_ty;
                const NAME: &'static str = #name;
                const EXPLICIT_NAME: bool = #explicit_name;

                fn handle<'a>(
                    &'a self,
                    event: #event_ty,
                    conn: &'a mut #krate::__private::PgConnection,
                ) -> #krate::__private::BoxFuture<'a, ::core::result::Result<(), #krate::inbox::HandlerError>> {
                    ::std::boxed::Box::pin(#ident::call(event, conn))
                }
            }
        };
    }
}
