//! How the core takes a store ([`Handle`]), and what beginning a call ends with ([`Begun`]).

use std::any::Any;
use std::sync::Arc;

use bytes::Bytes;

use super::held::Held;
use crate::Store;

/// A store as the core takes it: borrowed to settle, shared to hold a claim. Implemented
/// for every store type, so that the core is not generic over it.
pub(super) trait Handle: Send + Sync {
    fn get(&self) -> &dyn Store;

    /// A store that already is an `Arc<dyn Store>` (the default store) is cloned; any other
    /// is put in one (a first execution's only allocation of its own; a replay never gets
    /// here).
    fn shared(&self) -> Arc<dyn Store>;
}

impl<S: Store + Clone> Handle for S {
    fn get(&self) -> &dyn Store {
        self
    }

    fn shared(&self) -> Arc<dyn Store> {
        match (self as &dyn Any).downcast_ref::<Arc<dyn Store>>() {
            Some(shared) => Arc::clone(shared),
            None => Arc::new(self.clone()),
        }
    }
}

/// What beginning a call ended with: a record to replay, or a claim to run the body under.
pub(super) enum Begun {
    Replay(Bytes),
    Run(Held),
}
