//! The attempt a body runs under, visible to the body through [`attempt()`], and the check
//! that keeps a call from waiting for its own enclosing call.

use std::fmt;

use std::sync::Arc;

use crate::{Error, Flights, Key, Store, Token};

tokio::task_local! {
    static CURRENT: Attempt;
}

/// The claim under which a body is running: its key and its fencing token.
///
/// Downstream writes carry the token so that a holder whose lease ran out and was taken
/// over cannot overwrite the newer holder's effects:
/// `UPDATE accounts SET …, fence = $token WHERE id = $id AND fence < $token`.
///
/// ```
/// use idem_runtime::{attempt, MemoryStore, Operation};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::Error> {
/// let store = MemoryStore::new();
/// let op = Operation::new("ledger.transfer.v1");
/// let key = op.key(&"transfer-9")?;
/// assert!(attempt().is_none(), "outside a body there is no attempt");
/// let token = op
///     .run(&store, &key, None, async {
///         let attempt = attempt().expect("inside a body");
///         Ok::<_, idem_runtime::Error>(attempt.token().get())
///     })
///     .await?
///     .into_inner();
/// assert!(token > 0);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Attempt(Arc<Frame>);

struct Frame {
    key: Key,
    token: Token,
    /// Which store the claim is in (its registry's address), so that the same key in
    /// another store is not mistaken for this one.
    store: usize,
    /// The attempt of the call whose body made this call, if any.
    enclosing: Option<Attempt>,
}

impl Attempt {
    /// The attempt of the body `store` runs for `key` under `token`, inside the current one.
    pub(crate) fn enter<S: Store + ?Sized>(store: &S, key: Key, token: Token) -> Self {
        Self(Arc::new(Frame {
            key,
            token,
            store: store_id(store),
            enclosing: attempt(),
        }))
    }

    /// The key the body runs under.
    pub fn key(&self) -> &Key {
        &self.0.key
    }

    /// The claim's fencing token: strictly larger than the token of any earlier claim of
    /// the same key.
    pub fn token(&self) -> Token {
        self.0.token
    }

    /// Runs `body` with this attempt as the current one.
    #[cfg(any(test, feature = "postgres"))]
    pub(crate) fn scope<F: std::future::Future>(
        self,
        body: F,
    ) -> impl std::future::Future<Output = F::Output> {
        CURRENT.scope(self, body)
    }

    /// Runs `f` with this attempt as the current one: one poll of a body.
    pub(crate) fn sync_scope<R>(self, f: impl FnOnce() -> R) -> R {
        CURRENT.sync_scope(self, f)
    }

    fn chain(&self) -> impl Iterator<Item = &Frame> {
        std::iter::successors(Some(&*self.0), |frame| {
            frame.enclosing.as_ref().map(|a| &*a.0)
        })
    }
}

impl fmt::Debug for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Attempt")
            .field("key", &self.0.key.short().to_string())
            .field("token", &self.0.token)
            .finish_non_exhaustive()
    }
}

/// The attempt of the body this code runs in, if it runs inside one: the body of an
/// `#[idempotent]` function or of [`Operation::run`](crate::Operation::run) that claimed its
/// key. `None` outside, in a replay, and in tasks the body spawned itself.
pub fn attempt() -> Option<Attempt> {
    CURRENT.try_with(Attempt::clone).ok()
}

/// Whether `key` in `store` is held by the body this code runs in or by one enclosing it.
pub(crate) fn held_by_caller<S: Store + ?Sized>(store: &S, key: &Key) -> bool {
    let store = store_id(store);
    CURRENT
        .try_with(|current| {
            current
                .chain()
                .any(|frame| frame.key == *key && frame.store == store)
        })
        .unwrap_or(false)
}

/// `Error::InProgress`, logged, when `key` in `store` is held by the body this code runs in
/// or by one enclosing it: waiting for it would never end.
pub(crate) fn refuse_recursion<S: Store + ?Sized>(store: &S, key: &Key) -> Result<(), Error> {
    if held_by_caller(store, key) {
        tracing::warn!(
            outcome = "rejected",
            "the key is held by this call's own enclosing call; waiting would never end"
        );
        return Err(Error::InProgress);
    }
    Ok(())
}

/// Stores are told apart by their in-process registry; stores without one are all `0`.
fn store_id<S: Store + ?Sized>(store: &S) -> usize {
    store
        .flights()
        .map_or(0, |flights| std::ptr::from_ref::<Flights>(flights) as usize)
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use super::*;
    use crate::MemoryStore;

    #[tokio::test]
    async fn a_key_is_held_by_the_caller_only_in_the_same_store() {
        let (a, b) = (MemoryStore::new(), MemoryStore::new());
        let key = Key::derive("attempt", &1).unwrap();
        let other = Key::derive("attempt", &2).unwrap();
        assert!(!held_by_caller(&a, &key), "outside any attempt");
        let outer = Attempt::enter(&a, key, Token::new(1));
        outer
            .scope(async {
                assert!(held_by_caller(&a, &key));
                assert!(!held_by_caller(&b, &key), "the same key in another store");
                assert!(!held_by_caller(&a, &other));
                let inner = Attempt::enter(&b, other, Token::new(2));
                inner
                    .scope(async {
                        assert!(held_by_caller(&a, &key), "an enclosing call's key");
                        assert!(held_by_caller(&b, &other));
                    })
                    .await;
            })
            .await;
    }
}
