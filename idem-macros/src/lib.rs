//! The `#[idempotent]` attribute. Use it through `idem_runtime::idempotent`, whose
//! documentation describes every argument; this crate is an implementation detail.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod attr;
mod expand;
mod item;

use proc_macro::TokenStream;

/// Makes an `async fn` idempotent. See `idem_runtime::idempotent` for the arguments.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(attr.into(), item.into()).into()
}
