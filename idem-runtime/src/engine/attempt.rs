//! The attempt a body runs under, visible to the body through [`attempt()`], and the check
//! that keeps a call from waiting for its own enclosing call.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::OnceCell;

use super::lease::Lease;
use super::settings::Settings;
use crate::key::KeyHasher;
use crate::{Error, Fingerprint, Flights, Key, Store, Token};

tokio::task_local! {
    static CURRENT: Scope;
}

/// What the code polled in a task runs inside: the claim of the innermost call that holds
/// one, and whether the innermost call runs with no key at all (its steps then run as
/// plain futures).
#[derive(Clone)]
struct Scope {
    attempt: Option<Attempt>,
    unkeyed: bool,
}

/// The claim under which a body is running: its key and its fencing token.
///
/// Downstream writes carry the token so that a holder whose lease ran out and was taken
/// over cannot overwrite the newer holder's effects:
/// `UPDATE accounts SET …, fence = $token WHERE id = $id AND fence < $token`.
///
/// The token is taken when the body first asks for it, so that a claim costs no clock
/// reading on a store whose claims need none (Redis): bodies that never fence pay nothing.
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
///         Ok::<_, idem_runtime::Error>(attempt.token().await?.get())
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
    /// The claim's own token.
    token: Token,
    /// Where the fencing token comes from.
    fence: Fence,
    /// Which store the claim is in (its registry's address), so that the same key in
    /// another store is not mistaken for this one.
    store: usize,
    /// The attempt of the call whose body made this call, if any.
    enclosing: Option<Attempt>,
    /// What the body's [`step`](crate::step)s need: where and for how long they are
    /// recorded, and how their occurrences are counted; shared with the steps' own attempts.
    journal: Arc<Journal>,
    /// Whether the claim took the key over from a claim that was never settled, and what
    /// [`reconcile`](crate::reconcile()) made of it: a [`Doubt`] as a byte.
    doubt: AtomicU8,
    /// How many requests of each method and target the body sent so far without a key of
    /// their own ([`request_key`]).
    requests: Mutex<HashMap<Box<str>, u32>>,
}

/// What is known of the effect of an earlier claim that this call's claim took over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Doubt {
    /// Nothing to know: the key was fresh, released, or expired; or a step's frame.
    None = 0,
    /// The earlier claim's outcome is unknown and nothing asked yet.
    Unknown = 1,
    /// `reconcile` is asking, or its lookup failed: still unknown.
    Asking = 2,
    /// `reconcile` found no effect: the body runs as on a fresh key.
    Absent = 3,
    /// `reconcile` found the effect: its value is the call's, answered as a replay.
    Found = 4,
}

impl Doubt {
    fn of(raw: u8) -> Self {
        match raw {
            1 => Self::Unknown,
            2 => Self::Asking,
            3 => Self::Absent,
            4 => Self::Found,
            _ => Self::None,
        }
    }
}

/// Where an attempt's fencing token comes from.
enum Fence {
    /// The claim's token is the fencing token (a transactional claim: from a sequence).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Claim,
    /// The store takes one when the body first asks ([`Store::fence`]), kept for later asks.
    Store {
        store: Arc<dyn Store>,
        taken: OnceLock<Token>,
    },
    /// A step's attempt: the fencing token of the call it is a step of.
    Call(Attempt),
}

impl Attempt {
    /// The attempt of the body `store` runs for `key` under `token`, inside the current one;
    /// its fencing token is taken from `store` when asked for. `taken_over` if the claim
    /// took the key over from a claim that was never settled.
    pub(crate) fn enter(
        store: &Arc<dyn Store>,
        key: Key,
        token: Token,
        journal: Journal,
        taken_over: bool,
    ) -> Self {
        let fence = Fence::Store {
            store: Arc::clone(store),
            taken: OnceLock::new(),
        };
        let attempt = Self::with_fence(&**store, key, token, fence, Arc::new(journal));
        if taken_over {
            attempt
                .0
                .doubt
                .store(Doubt::Unknown as u8, Ordering::Relaxed);
        }
        attempt
    }

    /// Like [`enter`](Self::enter), for a claim whose token is already its fencing token.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn enter_fenced<S: Store + ?Sized>(
        store: &S,
        key: Key,
        token: Token,
        journal: Journal,
    ) -> Self {
        Self::with_fence(store, key, token, Fence::Claim, Arc::new(journal))
    }

    /// The attempt of this call's step `key`: inside the step's future, `attempt()` is it.
    /// It shares the call's journal (a step's own steps are the call's) and fences with
    /// the call's token, since the call's claim is what makes the step exclusive.
    pub(super) fn step(&self, key: Key) -> Self {
        Self(Arc::new(Frame {
            key,
            token: self.0.token,
            fence: Fence::Call(self.clone()),
            store: self.0.store,
            enclosing: Some(self.clone()),
            journal: Arc::clone(&self.0.journal),
            doubt: AtomicU8::new(Doubt::None as u8),
            requests: Mutex::new(HashMap::new()),
        }))
    }

    fn with_fence<S: Store + ?Sized>(
        store: &S,
        key: Key,
        token: Token,
        fence: Fence,
        journal: Arc<Journal>,
    ) -> Self {
        Self(Arc::new(Frame {
            key,
            token,
            fence,
            store: store_id(store),
            enclosing: attempt(),
            journal,
            doubt: AtomicU8::new(Doubt::None as u8),
            requests: Mutex::new(HashMap::new()),
        }))
    }

    /// The attempt of the call this one belongs to: itself, or for a step, its call's.
    pub(crate) fn call(&self) -> &Attempt {
        match &self.0.fence {
            Fence::Call(call) => call.call(),
            _ => self,
        }
    }

    /// What is known of the earlier claim this call's claim took over.
    pub(crate) fn doubt(&self) -> Doubt {
        Doubt::of(self.call().0.doubt.load(Ordering::Acquire))
    }

    /// Moves the call's [`Doubt`] from `from` to `to`; whether it was `from`.
    pub(crate) fn resolve(&self, from: Doubt, to: Doubt) -> bool {
        self.call()
            .0
            .doubt
            .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Whether the body may not release the key when it ends without a value: the claim it
    /// took over had an unknown outcome that is still unknown (nothing asked, or the asking
    /// failed), or whose effect `reconcile` found. The claim then lapses, and the next claim
    /// is told it took the key over. Only `reconcile` finding no effect settles the doubt.
    pub(crate) fn in_doubt(&self) -> bool {
        matches!(self.doubt(), Doubt::Unknown | Doubt::Asking | Doubt::Found)
    }

    /// Whether `reconcile` found the effect of the claim this call took over: the call's
    /// value is then answered as a replay.
    pub(crate) fn reconciled(&self) -> bool {
        self.doubt() == Doubt::Found
    }

    /// Whether this call's claim took the key over from a claim that was never settled
    /// (its holder's lease ran out while its body ran, or an operator released it): the
    /// earlier body's effect may have happened. [`reconcile`](crate::reconcile()) asks the
    /// destination first when this is true.
    pub fn taken_over(&self) -> bool {
        self.doubt() != Doubt::None
    }

    /// What this attempt's steps are recorded with.
    pub(super) fn journal(&self) -> &Journal {
        &self.0.journal
    }

    /// The key the body runs under. Inside a [`step`](crate::step()), the step's own key:
    /// derived from the call's key and fingerprint, the step's name and its occurrence (the
    /// first step of a name is occurrence 0, the next 1, …), the same on every attempt of
    /// the call, so two steps of one name send different keys downstream, and a deploy that
    /// removes one of them shifts the others' keys: name steps by what they do to what.
    pub fn key(&self) -> &Key {
        &self.0.key
    }

    /// The claim's fencing token: strictly larger than the fencing token of any earlier
    /// claim of the same key. The first ask may cost the store one round trip (Redis); later
    /// asks under the same claim return the same token at once.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached, or when this claim is no longer
    /// held (its lease ran out, or the record was removed): the body must then not write
    /// downstream, and returning the error ends the call without recording anything.
    pub async fn token(&self) -> Result<Token, Error> {
        let (store, taken) = match &self.0.fence {
            Fence::Claim => return Ok(self.0.token),
            Fence::Call(call) => return Box::pin(call.token()).await,
            Fence::Store { store, taken } => (store, taken),
        };
        if let Some(token) = taken.get() {
            return Ok(*token);
        }
        match store.fence(&self.0.key, self.0.token).await? {
            Some(token) => Ok(*taken.get_or_init(|| token)),
            None => Err(Error::store(
                "this call's claim is no longer held (its lease ran out or its record was removed): it takes no fencing token",
            )),
        }
    }

    /// Runs `body` with this attempt as the current one.
    pub(crate) fn scope<F: std::future::Future>(
        self,
        body: F,
    ) -> impl std::future::Future<Output = F::Output> {
        CURRENT.scope(self.current(), body)
    }

    /// Runs `f` with this attempt as the current one: one poll of a body.
    pub(crate) fn sync_scope<R>(self, f: impl FnOnce() -> R) -> R {
        CURRENT.sync_scope(self.current(), f)
    }

    fn current(self) -> Scope {
        Scope {
            attempt: Some(self),
            unkeyed: false,
        }
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
    CURRENT
        .try_with(|scope| scope.attempt.clone())
        .ok()
        .flatten()
}

/// The `Idempotency-Key` a request sent from the body this code runs in takes downstream,
/// if it runs inside a keyed call (or a step of one): derived from that call's (or step's)
/// key, the request's `method` and `target`, and its occurrence (how many requests of that
/// method and target the attempt sent before it), so that every attempt of the call, and
/// every redelivery of the message that makes it, sends each of its requests under the
/// same key, and two requests of one body under two. `None` outside every keyed call.
#[cfg_attr(not(feature = "client"), allow(dead_code))]
pub(crate) fn request_key(method: &str, target: &str) -> Option<Key> {
    let attempt = CURRENT
        .try_with(|scope| scope.attempt.clone())
        .ok()
        .flatten()?;
    let frame = &*attempt.0;
    let occurrence = {
        let mut seen = frame
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let name = format!("{method} {target}");
        let count = seen.entry(name.into_boxed_str()).or_insert(0);
        *count += 1;
        *count - 1
    };
    Some(derived_request_key(&frame.key, method, target, occurrence))
}

/// The key of occurrence `occurrence` of a request of `method` to `target` sent in the body
/// of the call (or step) `parent`: a sha256 digest apart from every key [`Key::derive`] and
/// every step's key make.
fn derived_request_key(parent: &Key, method: &str, target: &str, occurrence: u32) -> Key {
    use sha2::{Digest, Sha256};
    let mut digest = Sha256::new();
    digest.update(b"idem.request\0");
    digest.update(parent.as_bytes());
    for part in [method, target] {
        digest.update((part.len() as u64).to_be_bytes());
        digest.update(part.as_bytes());
    }
    digest.update(occurrence.to_be_bytes());
    Key::from_bytes(digest.finalize().into())
}

/// Where a [`step`](crate::step) is called.
pub(crate) enum Place {
    /// Outside every idempotent call.
    Outside,
    /// In the body of a call with no key.
    Unkeyed,
    /// In the body of a call that holds its key.
    Claimed(Attempt),
}

/// Where the code that calls this runs.
pub(crate) fn place() -> Place {
    match CURRENT.try_with(Scope::clone) {
        Err(_) => Place::Outside,
        Ok(Scope { unkeyed: true, .. }) => Place::Unkeyed,
        Ok(Scope {
            attempt: Some(attempt),
            ..
        }) => Place::Claimed(attempt),
        Ok(Scope { attempt: None, .. }) => Place::Outside,
    }
}

/// Runs `f` (one poll of the body of a call without a key) as such a body: the claims of
/// enclosing calls stay visible, and steps run as plain futures.
pub(crate) fn sync_scope_unkeyed<R>(f: impl FnOnce() -> R) -> R {
    CURRENT.sync_scope(unkeyed(), f)
}

/// [`sync_scope_unkeyed`] for a whole future.
pub(crate) fn scope_unkeyed<F: std::future::Future>(
    body: F,
) -> impl std::future::Future<Output = F::Output> {
    CURRENT.scope(unkeyed(), body)
}

fn unkeyed() -> Scope {
    Scope {
        attempt: attempt(),
        unkeyed: true,
    }
}

/// What the steps of one attempt are recorded with.
pub(crate) struct Journal {
    /// The call's key: its steps are recorded under it, and their keys start with its first
    /// bytes.
    pub(super) call: Key,
    /// The enclosing call's fingerprint: a retry with another payload runs its own steps.
    pub(super) fingerprint: Option<Fingerprint>,
    /// How long the steps' records live: the call's TTL.
    pub(super) ttl: Duration,
    /// The enclosing claim, whose lease a step checks before it starts and whose token
    /// fences its record; `None` for a claim in the caller's transaction, whose steps are
    /// not recorded (see [`step`](crate::step)).
    pub(super) holder: Option<Arc<Lease>>,
    /// The steps earlier attempts recorded, read once, when the first step of this
    /// attempt asks.
    recorded: OnceCell<HashMap<Key, Bytes, KeyHasher>>,
    /// How many times each step name was used so far in this attempt.
    seen: Mutex<HashMap<Box<str>, u32>>,
}

impl Journal {
    /// The journal of a claim in the caller's transaction: its steps run unrecorded.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn in_transaction(
        call: Key,
        settings: &Settings,
        fingerprint: Option<Fingerprint>,
    ) -> Self {
        Self::new(call, settings, fingerprint, None)
    }

    pub(super) fn new(
        call: Key,
        settings: &Settings,
        fingerprint: Option<Fingerprint>,
        holder: Option<Arc<Lease>>,
    ) -> Self {
        Self {
            call,
            fingerprint,
            ttl: settings.ttl,
            holder,
            recorded: OnceCell::new(),
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// The occurrence of step `name` that this call of it is: `0` for the first, and one
    /// more for each later one in this attempt.
    pub(super) fn occurrence(&self, name: &str) -> u32 {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        match seen.get_mut(name) {
            Some(count) => {
                *count += 1;
                *count - 1
            }
            None => {
                seen.insert(name.into(), 1);
                0
            }
        }
    }

    /// The steps that earlier attempts of the call recorded: one round trip to `holder`'s
    /// store for the first step of this attempt, none after.
    pub(super) async fn recorded(
        &self,
        holder: &Lease,
    ) -> Result<&HashMap<Key, Bytes, KeyHasher>, Error> {
        self.recorded
            .get_or_try_init(|| async {
                let steps = holder.store.steps(&self.call).await?;
                Ok(steps.into_iter().collect())
            })
            .await
    }
}

/// Whether `key` in `store` is held by the body this code runs in or by one enclosing it.
pub(crate) fn held_by_caller<S: Store + ?Sized>(store: &S, key: &Key) -> bool {
    let store = store_id(store);
    CURRENT
        .try_with(|current| {
            current.attempt.as_ref().is_some_and(|attempt| {
                attempt
                    .chain()
                    .any(|frame| frame.key == *key && frame.store == store)
            })
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

    #[test]
    fn request_keys_differ_by_call_method_target_and_occurrence() {
        let call = Key::derive("requests", &1).unwrap();
        let key = |parent: &Key, method: &str, target: &str, n: u32| {
            derived_request_key(parent, method, target, n)
        };
        let base = key(&call, "POST", "https://pay.example/charges", 0);
        assert_eq!(base, key(&call, "POST", "https://pay.example/charges", 0));
        for differs in [
            key(
                &Key::derive("requests", &2).unwrap(),
                "POST",
                "https://pay.example/charges",
                0,
            ),
            key(&call, "PATCH", "https://pay.example/charges", 0),
            key(&call, "POST", "https://pay.example/refunds", 0),
            key(&call, "POST", "https://pay.example/charges", 1),
            // Lengths are part of the digest: no bytes shift between method and target.
            key(&call, "POS", "Thttps://pay.example/charges", 0),
        ] {
            assert_ne!(base, differs);
        }
        assert_ne!(base, call, "apart from the call's own key");
    }

    #[tokio::test]
    async fn a_key_is_held_by_the_caller_only_in_the_same_store() {
        let (a, b) = (MemoryStore::new(), MemoryStore::new());
        let key = Key::derive("attempt", &1).unwrap();
        let other = Key::derive("attempt", &2).unwrap();
        assert!(!held_by_caller(&a, &key), "outside any attempt");
        let journal = |key: Key| {
            let settings = crate::Operation::new("attempt").settings;
            Journal::in_transaction(key, &settings, None)
        };
        let outer = Attempt::enter_fenced(&a, key, Token::new(1), journal(key));
        outer
            .scope(async {
                assert!(held_by_caller(&a, &key));
                assert!(!held_by_caller(&b, &key), "the same key in another store");
                assert!(!held_by_caller(&a, &other));
                let inner = Attempt::enter_fenced(&b, other, Token::new(2), journal(other));
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
