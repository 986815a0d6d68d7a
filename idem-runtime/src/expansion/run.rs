//! The entry points of the expansion: a call through `Operation::run` and
//! `Operation::run_to_completion`, after a look for its record.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::{default_store, FromIdemError, IntoTyping, Recordable, StoreValue};
use crate::codec::Json;
use crate::engine::{Found, IdemResult, Started};
use crate::{Error, ErrorPolicy, Fingerprint, Key, Operation, Store};

/// The key and fingerprint an expansion derived: the first error deriving them is the
/// function's error (the body never runs); an absent optional key runs the body with no
/// claim.
#[inline]
pub(super) fn derived(
    key: Result<Option<Key>, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
) -> crate::engine::Derived {
    match key? {
        Some(key) => Ok(Some((key, fingerprint.transpose()?))),
        None => Ok(None),
    }
}

/// The bare return value of an `#[idempotent]` function.
#[inline]
pub fn bare<R: IdemResult>(outcome: Result<crate::Outcome<R::Ok>, R::Err>) -> R {
    R::from_result(outcome.map(crate::Outcome::into_inner))
}

/// What the entry points answer: the outcome (`name_outcome`), which `name` makes bare.
pub type Answered<R> = Result<crate::Outcome<<R as IdemResult>::Ok>, <R as IdemResult>::Err>;

fn answered<R: IdemResult>(outcome: Answered<R>) -> Answered<R> {
    outcome
}

/// `Operation::run`, after [`look`] (made before the body borrowed its arguments): the
/// answer at once when the look found the record, or the call to await. Generic over the
/// function's return type, so that a return type that is not a `Result` fails one bound,
/// with its own message. `typing` says whether a replay from a
/// store in this process may hand back the value itself.
#[inline]
pub fn run<'a, P, S, R, F, Y>(
    operation: &'a Operation<P>,
    store: Looked<S>,
    body: F,
    typing: Y,
) -> Started<Answered<R>, Pin<Box<impl Future<Output = Answered<R>> + use<'a, P, S, R, F, Y>>>>
where
    R: IdemResult,
    R::Ok: Recordable,
    R::Err: FromIdemError,
    P: ErrorPolicy<R::Err>,
    S: StoreValue,
    F: Future<Output = R>,
    Y: IntoTyping<R::Ok>,
{
    let typing = typing.into_typing();
    let (store, derived) = match store.0 {
        Look::Found(Ok(found)) => {
            return Started::Now(operation.replayed::<Json, R>(&found, typing));
        }
        Look::Found(Err(err)) => return Started::Now(Err(err.into())),
        Look::Store(store, derived) => (store, derived),
    };
    // The future owns the store's handle, which the call borrows. Boxed: the call's state
    // (about a kilobyte) would otherwise sit inline in every `#[idempotent]` function's
    // future, and a replay answered at once would still move it wherever its future goes.
    Started::Later(Box::pin(async move {
        let call = operation.call::<Json, S, R, F, Answered<R>>(
            &store,
            derived,
            body,
            answered::<R>,
            typing,
            true,
        );
        call.await
    }))
}

/// A call's store after its look for the call's record ([`look`]).
pub struct Looked<S>(Look<S>);

enum Look<S> {
    /// The record, at hand: the call is answered by it.
    Found(Result<Found, Error>),
    /// No record at hand (or no key to look for): an owned handle to the store to run the
    /// call in, and the call's key and fingerprint.
    Store(S, crate::engine::Derived),
}

/// The store of a `store = <expr>` value, looked at first: the record of the call's key, if
/// the store has it at hand (a replay from memory then takes nothing else of the store),
/// else an owned handle to it, so that the body may still move or mutably borrow what the
/// store expression borrowed (`self`). Stores are cheap handles: this is an `Arc` clone.
#[inline]
pub fn look<P, S: StoreValue>(
    operation: &Operation<P>,
    store: &S,
    key: Result<Option<Key>, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
) -> Looked<S> {
    // A call without a key, or with a derivation error, is answered by the call itself. The
    // look borrows the key and the fingerprint where they are: a replay moves neither.
    if let Ok(Some(key)) = &key {
        if let Ok(fingerprint) = fingerprint.as_ref().map(Result::as_ref).transpose() {
            if let Some(found) = operation.settings.replay_at_once(store, key, fingerprint) {
                return Looked(Look::Found(found));
            }
        }
    }
    Looked(Look::Store(store.clone(), derived(key, fingerprint)))
}

/// [`look`], in the default store.
pub fn look_default<P>(
    operation: &Operation<P>,
    key: Result<Option<Key>, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
) -> Looked<Arc<dyn Store>> {
    look(operation, default_store(), key, fingerprint)
}

/// `Operation::run_to_completion`, as [`run`].
#[inline]
pub fn run_to_completion<'a, P, S, R, F>(
    operation: &'a Operation<P>,
    store: Looked<S>,
    body: F,
) -> Started<Answered<R>, Pin<Box<impl Future<Output = Answered<R>> + use<'a, P, S, R, F>>>>
where
    R: IdemResult,
    R::Ok: Recordable + Send + 'static,
    R::Err: FromIdemError + Send + 'static,
    P: ErrorPolicy<R::Err> + Clone + Send + Sync + 'static,
    S: StoreValue,
    F: Future<Output = R> + Send + 'static,
{
    let (store, derived) = match store.0 {
        Look::Found(found) => {
            // Refused outside a tokio runtime, as a call that runs is: replay or not.
            let replayed = crate::engine::spawner()
                .and(found)
                .map_err(Into::into)
                .and_then(|found| operation.replayed::<Json, R>(&found, None));
            return Started::Now(replayed);
        }
        Look::Store(store, derived) => (store, derived),
    };
    // Boxed, as in [`run`].
    Started::Later(Box::pin(async move {
        operation
            .run_to_completion_as::<Json, S, R, F>(&store, derived, body, true)
            .await
    }))
}

/// `label = …`: the label, owned at once (the body may then move what it was made of).
#[inline]
pub fn label(label: impl Into<Arc<str>>) -> Arc<str> {
    label.into()
}

pub use crate::engine::label::labelled;
pub use crate::engine::reconcile::reconciled;
