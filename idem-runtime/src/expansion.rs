//! What `#[idempotent]` expands to (reached through `__private`), one file a concern. Not a
//! public API: no stability promise.

mod bounds;
mod key;
mod run;
mod store;
mod transaction;
mod typing;

pub use self::bounds::*;
pub use self::key::*;
pub use self::run::*;
pub use self::store::*;
pub use self::transaction::*;
pub use self::typing::*;
pub use crate::engine::{IdemResult, Started, Typing};
pub use crate::{ErrorPolicy, InFlight, Operation};
