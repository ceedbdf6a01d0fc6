use std::fmt::Display;

use proc_macro2::Span;
use quote::ToTokens;

/// Collects errors so that the macro reports all of them at once instead of stopping at the first.
#[derive(Default)]
pub struct Ctxt {
    errors: Option<syn::Error>,
}

impl Ctxt {
    pub fn error_spanned_by<T: ToTokens, M: Display>(&mut self, tokens: T, msg: M) {
        self.push(syn::Error::new_spanned(tokens, msg));
    }

    pub fn error_at<M: Display>(&mut self, span: Span, msg: M) {
        self.push(syn::Error::new(span, msg));
    }

    pub fn push(&mut self, error: syn::Error) {
        match &mut self.errors {
            Some(errors) => errors.combine(error),
            None => self.errors = Some(error),
        }
    }

    /// `Err` with every collected error combined, or `Ok` when there were none.
    pub fn check(self) -> syn::Result<()> {
        match self.errors {
            Some(errors) => Err(errors),
            None => Ok(()),
        }
    }
}
