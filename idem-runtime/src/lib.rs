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
//! - [`idempotent`]: the attribute, sugar over [`Operation`].
//! - [`Key`] and [`Fingerprint`]: deterministic sha256 digests of `Serialize` values.
//! - [`Store`]: where claims and results live; [`MemoryStore`] is the embedded default;
//!   `RedisStore`, `PostgresStore`, `SqliteStore` and `MySqlStore` (features `redis`, `postgres`, `sqlite`, `mysql`)
//!   are shared and durable; [`TieredStore`] puts a fast store in front of a durable one.
//! - [`Operation`]: runs a future at most once per key, with its policies.
//! - [`Error`]: why a call did not produce a value of its own.
//! - `http` (feature `http`): the `Idempotency-Key` header as a tower layer; `http::client`
//!   (feature `client`): the client's half, one key per logical request and safe retries.
//! - [`Operation::run_in_transaction`] (features `postgres`, `sqlite`, `mysql`): the claim,
//!   the body's writes and the record in the caller's own transaction, committed together.
//! - [`attempt()`]: the key and fencing token of the claim a body runs under.
//! - [`step()`]: a recorded step of a body, so that a retry after a crash resumes at the
//!   first step that did not finish.
//! - [`reconcile()`]: asks the destination of a body's effect whether an attempt that died
//!   mid-body had it, before the body runs again.
//! - `metrics` (feature `metrics`): outcome counts and claim latency, by namespace, through
//!   the `metrics` facade.
//!
//! Running it: the [`guide`] has keys and fingerprints and their pitfalls, sizing leases and
//! TTLs, choosing a store, what happens when things break, the failure model measured store
//! by store, and every guarantee with the test behind it.

#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// What `#[idempotent]` expands to, through `__private` (design §7). The items are defined
// under a name that reads well where the compiler quotes it ("required by a bound in
// `idem_runtime::expansion::key`"): a note never sends a user to a module called private.
#[doc(hidden)]
pub mod expansion;
#[doc(hidden)]
pub mod __private {
    pub use crate::expansion::*;
}
#[cfg(feature = "admin")]
#[cfg_attr(docsrs, doc(cfg(feature = "admin")))]
pub mod admin;
mod background;
mod codec;
pub mod consumer;
mod default_store;
mod engine;
mod error;
mod flights;
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub mod grpc;
pub mod guide;
#[cfg(feature = "http")]
pub mod http;
mod idempotency_key;
mod key;
mod limits;
#[cfg(feature = "rmcp")]
#[cfg_attr(docsrs, doc(cfg(feature = "rmcp")))]
pub mod mcp;
mod meter;
#[cfg(feature = "metrics")]
pub mod metrics;
mod namespace;
pub mod store;
#[cfg(feature = "testkit")]
#[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
pub mod testkit;

pub use crate::background::{drain, Undrained};
pub use crate::codec::{CacheErrors, ErrorPolicy, ReleaseErrors};
pub use crate::default_store::{default_store, set_default_store, DefaultStoreError};
pub use crate::engine::attempt::{attempt, Attempt};
pub use crate::engine::label::labelled;
pub use crate::engine::reconcile::reconcile;
pub use crate::engine::steps::step;
pub use crate::engine::{InFlight, Operation, Outcome, DEFAULT_LEASE, DEFAULT_TTL, DEFAULT_WAIT};
pub use crate::error::{BoxError, Error, RETRY_AFTER};
pub use crate::flights::Flights;
pub use crate::idempotency_key::IdempotencyKey;
pub use crate::key::{Fingerprint, Key, FORMAT_VERSION};
pub use crate::limits::{MAX_DURATION, MIN_LEASE};
#[cfg(feature = "dynamodb")]
#[doc(inline)]
pub use crate::store::dynamodb::DynamoDbStore;
#[cfg(feature = "memory")]
#[doc(inline)]
pub use crate::store::memory::{MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "mysql")]
#[doc(inline)]
pub use crate::store::mysql::MySqlStore;
#[cfg(feature = "postgres")]
#[doc(inline)]
pub use crate::store::postgres::PostgresStore;
#[cfg(feature = "redis")]
#[doc(inline)]
pub use crate::store::redis::RedisStore;
#[cfg(feature = "sqlite")]
#[doc(inline)]
pub use crate::store::sqlite::SqliteStore;
#[doc(inline)]
pub use crate::store::tiered::TieredStore;
#[doc(inline)]
pub use crate::store::{Claim, ClaimRequest, Recorded, Store, Token};

// For implementors of `Store`, documented in `store` where they belong; kept here too so
// that `idem_runtime::{async_trait, Bytes}` go on working.
#[doc(hidden)]
pub use crate::store::{async_trait, Bytes};

/// Makes an `async fn` idempotent: the first call with a key runs the body and records its
/// `Ok` value; every later call with that key, within the TTL, returns the recorded value
/// without running the body, in this process or, with a shared store, in any process.
///
/// ```
/// use idem_runtime::idempotent;
/// # #[derive(serde::Serialize, serde::Deserialize)] struct Receipt { id: u64 }
/// # #[derive(Debug)] enum PayError { Idem(idem_runtime::Error) }
/// # impl From<idem_runtime::Error> for PayError { fn from(e: idem_runtime::Error) -> Self { Self::Idem(e) } }
/// # struct Order { id: u64, customer_id: u64, cents: u64 }
///
/// #[idempotent(key = (order.id, order.customer_id), ttl = "24h")]
/// async fn charge(order: &Order) -> Result<Receipt, PayError> {
///     Ok(Receipt { id: order.id })
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), PayError> {
/// # let order = Order { id: 1, customer_id: 2, cents: 3 };
/// # charge(&order).await?;
/// # Ok(())
/// # }
/// ```
///
/// The arguments, below, are the same table as the README's: both are tested against the
/// attribute's parser.
#[cfg(feature = "macros")]
#[doc(inline)]
pub use idem_macros::idempotent;
