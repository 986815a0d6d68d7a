//! Make async functions idempotent: claim a key, run the body once, record its `Ok` value,
//! and replay it to every later call with the same key.
//!
//! ```
//! use idem_runtime::{MemoryStore, Operation};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idem_runtime::Error> {
//! let store = MemoryStore::new();
//! let charge = Operation::new("billing.charge.v1");
//! let key = charge.key(&(17_u64, "cus_42"))?;
//!
//! let outcome = charge
//!     .run(&store, &key, None, async { Ok::<_, idem_runtime::Error>("rcpt_1".to_string()) })
//!     .await?;
//! assert!(!outcome.is_replayed());
//!
//! let outcome = charge
//!     .run(&store, &key, None, async { Ok::<_, idem_runtime::Error>("rcpt_2".to_string()) })
//!     .await?;
//! assert!(outcome.is_replayed());
//! assert_eq!(outcome.into_inner(), "rcpt_1");
//! # Ok(())
//! # }
//! ```
//!
//! The pieces:
//! - [`Key`] and [`Fingerprint`]: deterministic sha256 digests of `Serialize` values.
//! - [`Store`]: where claims and results live; [`MemoryStore`] is the embedded default.
//! - [`Operation`]: runs a future at most once per key, with its policies.
//! - [`Error`]: why a call did not produce a value of its own.
//!
//! See the repository README for the guarantees and how each is tested.

#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

mod codec;
mod default_store;
mod engine;
mod error;
mod flights;
mod key;
pub mod store;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use crate::codec::{CacheErrors, ErrorPolicy, ReleaseErrors};
pub use crate::default_store::{default_store, set_default_store, DefaultStoreError};
pub use crate::engine::{InFlight, Operation, Outcome, DEFAULT_LEASE, DEFAULT_TTL};
pub use crate::error::{BoxError, Error};
pub use crate::flights::Flights;
pub use crate::key::{Fingerprint, Key, FORMAT_VERSION};
#[cfg(feature = "memory")]
pub use crate::store::memory::{MemoryStore, MemoryStoreBuilder};
pub use crate::store::{Claim, Store, Token};

/// Re-exported for implementors of [`Store`]: the trait is written with it.
pub use async_trait::async_trait;
/// Re-exported: record values are [`Bytes`].
pub use bytes::Bytes;
