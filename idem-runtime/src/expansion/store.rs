//! The store of a call: `store = <expr>`, or the default store.

use std::sync::Arc;

use crate::Store;

/// The store of a function without a `store` argument.
pub fn default_store() -> &'static Arc<dyn Store> {
    crate::default_store()
}

/// Takes a `store = <expr>` value by reference through method auto-ref: `MemoryStore`,
/// `&MemoryStore` and `Arc<dyn Store>` values all become `&S`.
pub trait StoreArg {
    #[doc(hidden)]
    fn __idem_store(&self) -> &Self {
        self
    }
}

impl<T: ?Sized> StoreArg for T {}

/// An owned handle to the store, so that the body may still move or mutably borrow what the
/// store expression borrowed (`self`). Stores are cheap handles: this is an `Arc` clone.
pub fn owned_store<S: StoreValue>(store: &S) -> S {
    store.clone()
}

/// A `store = …` value: a `Store + Clone`, as one bound with one message.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotency store",
    label = "`store =` needs a `Store + Clone` value, or a reference to one",
    note = "use `MemoryStore` or a store of a backend feature (`cargo doc` lists every `impl Store`), an `Arc<dyn Store>`, or implement `idem_runtime::Store` and `Clone` (a cheap handle)"
)]
pub trait StoreValue: Store + Clone {}

#[diagnostic::do_not_recommend]
impl<S: Store + Clone> StoreValue for S {}
