//! The `#[idempotent]` attribute. Use it through `idem_runtime::idempotent`, which
//! re-exports it with examples; its arguments are documented on [`idempotent`] (the same
//! table as the README's). This crate is an implementation detail.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod attr;
mod expand;
mod item;

use proc_macro::TokenStream;

/// # Arguments
///
#[doc = include_str!("reference.md")]
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(attr.into(), item.into()).into()
}
