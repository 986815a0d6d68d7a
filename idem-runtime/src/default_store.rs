//! The process-wide store used when `#[idempotent]` names none.

use std::sync::{Arc, OnceLock};

use crate::Store;

static DEFAULT: OnceLock<Arc<dyn Store>> = OnceLock::new();

/// Sets the store that `#[idempotent]` functions without a `store` argument use.
///
/// Call it once at start-up, before the first such call: the default is fixed the first
/// time it is set or used.
///
/// ```
/// use idem_runtime::{set_default_store, MemoryStore};
///
/// set_default_store(MemoryStore::builder().capacity(1_000_000).build())?;
/// assert!(set_default_store(MemoryStore::new()).is_err()); // only once
/// # Ok::<(), idem_runtime::DefaultStoreError>(())
/// ```
///
/// # Errors
///
/// [`DefaultStoreError`] when the default store was already set, or already used (and so
/// built as an in-memory store).
pub fn set_default_store(store: impl Store) -> Result<(), DefaultStoreError> {
    DEFAULT
        .set(Arc::new(store))
        .map_err(|_| DefaultStoreError(()))
}

/// The process-wide default store: the one given to [`set_default_store`], or else an
/// in-memory [`MemoryStore`](crate::MemoryStore) built on first use.
///
/// Without the `memory` feature and without a store set, every operation of the returned
/// store fails with [`Error::Store`](crate::Error::Store), saying so.
pub fn default_store() -> &'static Arc<dyn Store> {
    DEFAULT.get_or_init(fallback)
}

#[cfg(feature = "memory")]
fn fallback() -> Arc<dyn Store> {
    Arc::new(crate::MemoryStore::new())
}

#[cfg(not(feature = "memory"))]
fn fallback() -> Arc<dyn Store> {
    Arc::new(unset::Unset)
}

#[cfg(not(feature = "memory"))]
mod unset {
    use std::time::Duration;

    use bytes::Bytes;

    use crate::{Claim, ClaimRequest, Error, Key, Store, Token};

    /// Stands in for the default store when there is none to build.
    pub(super) struct Unset;

    fn unset() -> Error {
        Error::store(
            "no default store: call `idem_runtime::set_default_store` at start-up, or enable the `memory` feature",
        )
    }

    #[async_trait::async_trait]
    impl Store for Unset {
        async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
            let _ = request;
            Err(unset())
        }

        async fn complete(&self, _: &Key, _: Token, _: Bytes, _: Duration) -> Result<bool, Error> {
            Err(unset())
        }

        async fn release(&self, _: &Key, _: Token) -> Result<bool, Error> {
            Err(unset())
        }

        async fn renew(&self, _: &Key, _: Token, _: Duration) -> Result<bool, Error> {
            Err(unset())
        }

        async fn fence(&self, _: &Key, _: Token) -> Result<Option<Token>, Error> {
            Err(unset())
        }

        async fn remove(&self, _: &Key) -> Result<bool, Error> {
            Err(unset())
        }
    }
}

/// The default store was already set or used; from [`set_default_store`].
#[derive(Debug, thiserror::Error)]
#[error("the default idempotency store was already set or used; set it once, at start-up")]
pub struct DefaultStoreError(());
