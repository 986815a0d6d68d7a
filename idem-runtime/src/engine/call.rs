//! One idempotent call as one future, split so that almost none of it is generic.
//!
//! Every `#[idempotent]` function instantiates the engine for its own types, in the user's
//! crate, on every build. So the generic part is kept to what needs the types: polling the
//! body in place (no copy of it into another future), encoding what it returned, decoding
//! a replay, and answering. Claiming, waiting, renewing, recording and releasing are
//! [`Phase`] and [`Held`] methods, compiled once (`scripts/build_time.py` measures
//! it).

use std::future::Future;
use std::marker::PhantomData;
use std::mem;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;

use super::attempt;
use super::handle::{Begun, Handle};
use super::held::{Beat, Ending, Held, Verdict};
use super::outcome::Outcome;
use super::settings::Settings;
use super::settle::Found;
use super::Operation;
use crate::codec::{self, ErrorPolicy, ValueCodec};
use crate::store::Typed;
use crate::{Error, Fingerprint, Key};

/// The shape every `#[idempotent]` function returns: `Result<T, E>`, or an alias of it.
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` functions must return `Result<T, E>`, not `{Self}`",
    label = "this must be a `Result`",
    note = "the `Ok` value is recorded and replayed; an `Err` releases the key, e.g. `-> Result<Receipt, PayError>`"
)]
pub trait IdemResult: Sized {
    /// The recorded value type.
    type Ok;
    /// The error type.
    type Err;
    /// Into a `Result`.
    fn into_result(self) -> Result<Self::Ok, Self::Err>;
    /// From a `Result`.
    fn from_result(result: Result<Self::Ok, Self::Err>) -> Self;
}

impl<T, E> IdemResult for Result<T, E> {
    type Ok = T;
    type Err = E;

    fn into_result(self) -> Self {
        self
    }

    fn from_result(result: Self) -> Self {
        result
    }
}

/// A derived key and fingerprint; `None` for an absent optional key; or the error that
/// deriving them ended with.
pub(crate) type Derived = Result<Option<(Key, Option<Fingerprint>)>, Error>;

/// How a call hands back its outcome: as `Result<Outcome<T>, E>` ([`Operation::run`]), or
/// as the bare return value of an `#[idempotent]` function.
pub(crate) type Answer<R, O> =
    fn(Result<Outcome<<R as IdemResult>::Ok>, <R as IdemResult>::Err>) -> O;

/// How a call keeps its success value beside the record, for a store in this process that
/// keeps it, and takes it back on a replay: a clone instead of a decoding. Only for a
/// `Clone` type, so it is chosen where the type is known (the macro's expansion); `None`
/// decodes.
pub struct Typing<T> {
    keep: fn(T) -> Typed,
    take: fn(&Typed) -> Option<T>,
}

impl<T> Clone for Typing<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Typing<T> {}

impl<T> Typing<T> {
    /// The value kept beside a record, if it is a `T`.
    #[inline]
    pub(super) fn taken(self, typed: &Typed) -> Option<T> {
        (self.take)(typed)
    }

    /// The record's own decoding, as it is kept beside the record.
    fn kept(self, decoded: T) -> Typed {
        (self.keep)(decoded)
    }
}

impl<T: Clone + Send + Sync + 'static> Typing<T> {
    /// The typing of a `Clone` value: the record's decoding kept in an `Arc`, taken back
    /// by cloning.
    pub(crate) fn cloned() -> Self {
        Self {
            keep: |decoded| Arc::new(decoded),
            take: |typed| typed.downcast_ref::<T>().cloned(),
        }
    }
}

/// How a call begins: answered at once (a record in memory, replayed without a future),
/// or a future to await. An `#[idempotent]` function matches on it before it awaits, so that
/// a replay never builds, moves or polls the call's future.
pub enum Started<A, F> {
    /// The answer, at once.
    Now(A),
    /// The call, to await.
    Later(F),
}

pin_project! {
    /// The future of one call.
    pub(crate) struct Call<'a, C, P, R, F, O>
    where
        R: IdemResult,
    {
        operation: &'a Operation<P>,
        #[pin]
        body: F,
        phase: Phase<'a>,
        output: Option<Result<R::Ok, R::Err>>,
        answer: Answer<R, O>,
        typing: Option<Typing<R::Ok>>,
        codec: PhantomData<fn() -> C>,
    }
}

impl<'a, C, P, R: IdemResult, F, O> Call<'a, C, P, R, F, O> {
    /// A call of `body` under `derived`, in `store`.
    pub(super) fn new(
        operation: &'a Operation<P>,
        store: &'a dyn Handle,
        derived: Derived,
        body: F,
        answer: Answer<R, O>,
        typing: Option<Typing<R::Ok>>,
        looked: bool,
    ) -> Self {
        let start = Phase::Start {
            store,
            derived,
            looked,
        };
        let mut call = Self::at(operation, start, body, answer);
        call.typing = typing;
        call
    }

    /// A call whose key is claimed already (`on_cancel = "complete"`, in its task).
    pub(super) fn running(
        operation: &'a Operation<P>,
        held: Held,
        body: F,
        answer: Answer<R, O>,
    ) -> Self {
        Self::at(operation, Phase::Running(held, None), body, answer)
    }

    fn at(operation: &'a Operation<P>, phase: Phase<'a>, body: F, answer: Answer<R, O>) -> Self {
        Self {
            operation,
            body,
            phase,
            output: None,
            answer,
            typing: None,
            codec: PhantomData,
        }
    }
}

impl<C, P, R, F, O> Future for Call<'_, C, P, R, F, O>
where
    C: ValueCodec<R::Ok>,
    R: IdemResult,
    R::Err: From<Error>,
    P: ErrorPolicy<R::Err>,
    F: Future<Output = R>,
{
    type Output = O;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<O> {
        let this = self.project();
        let operation = *this.operation;
        let typing = *this.typing;
        let mut slot = Slot::<C, P, R, F> {
            body: this.body,
            output: this.output,
            errors: &operation.errors,
            typing,
            codec: PhantomData,
        };
        let step = ready!(this.phase.advance(&operation.settings, cx, &mut slot));
        let outcome = match step {
            Step::Replay(found) => operation.replayed::<C, R>(&found, typing),
            Step::Failed(err @ Error::Unrecorded(_)) => match this.output.take() {
                // A codec whose values say they are not recorded answers with the value.
                Some(Ok(value)) => C::unrecorded(value)
                    .map(Outcome::Executed)
                    .ok_or_else(|| err.into()),
                _ => Err(err.into()),
            },
            Step::Failed(err) => Err(err.into()),
            Step::Executed { replayed } => match this.output.take() {
                Some(output) if replayed => output.map(Outcome::Replayed),
                Some(output) => output.map(Outcome::Executed),
                None => unreachable!("a call is executed only once its body returned"),
            },
        };
        Poll::Ready((this.answer)(outcome))
    }
}

/// The body, its output once it returned, and how to encode that: what [`Phase`] sees of
/// the call's types.
pub(crate) trait Body {
    /// Polls the body until it returns, then keeps its output.
    fn poll_body(&mut self, cx: &mut Context<'_>) -> Poll<()>;

    /// What the kept output asks of the record; with the value itself if `keep_typed` (the
    /// store keeps it) and the call can keep it.
    fn ending(&self, keep_typed: bool) -> Ending;
}

struct Slot<'s, C, P, R: IdemResult, F> {
    body: Pin<&'s mut F>,
    output: &'s mut Option<Result<R::Ok, R::Err>>,
    errors: &'s P,
    typing: Option<Typing<R::Ok>>,
    codec: PhantomData<fn() -> C>,
}

impl<C, P, R, F> Body for Slot<'_, C, P, R, F>
where
    C: ValueCodec<R::Ok>,
    R: IdemResult,
    P: ErrorPolicy<R::Err>,
    F: Future<Output = R>,
{
    fn poll_body(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.output.is_none() {
            let output = ready!(self.body.as_mut().poll(cx));
            *self.output = Some(output.into_result());
        }
        Poll::Ready(())
    }

    fn ending(&self, keep_typed: bool) -> Ending {
        match &*self.output {
            Some(Ok(value)) => {
                // Kept only as the record decodes: a codec that did not decode it keeps
                // nothing beside it, and its replays decode.
                let (encoded, decoded) = C::record_decoded(value);
                // The body ran: a value with no record of itself is recorded as gone.
                let encoded = encoded.unwrap_or_else(|err| codec::unrecordable(&err));
                let kept = encoded[..] != *codec::GONE;
                let typed = match (self.typing, decoded) {
                    (Some(typing), Some(decoded)) if keep_typed && kept => {
                        Some(typing.kept(decoded))
                    }
                    _ => None,
                };
                Ending::Value(encoded, typed)
            }
            Some(Err(err)) => Ending::Error(self.errors.encode(err)),
            // Never asked before the body returned; releasing is the safe answer anyway.
            None => Ending::Error(None),
        }
    }
}

/// Where a call is, apart from its types.
pub(crate) enum Phase<'a> {
    /// Not polled yet; `looked` if the caller looked for a record at hand already.
    Start {
        store: &'a dyn Handle,
        derived: Derived,
        looked: bool,
    },
    /// Settling the claim: waiting for a concurrent call, or for the store.
    Begin(Pin<Box<dyn Future<Output = Result<Begun, Error>> + Send + 'a>>),
    /// No key: the body runs with no claim.
    Unkeyed,
    /// The body runs under the claim.
    Running(Held, Beat),
    /// Recording or releasing; `true` if the value is the effect [`reconcile`] found.
    ///
    /// [`reconcile`]: crate::reconcile()
    Ending(Pin<Box<dyn Future<Output = Verdict> + Send>>, bool),
    /// Answered.
    Done,
}

/// Where a phase ended: the call's answer, short of its types.
enum Step {
    /// A record to replay, with its typed value if the store kept one and the call takes it.
    Replay(Found),
    Failed(Error),
    /// The body ran; its output is in the call. `replayed` if its value is the effect that
    /// [`reconcile`](crate::reconcile()) found of an earlier attempt.
    Executed {
        replayed: bool,
    },
}

impl<'a> Phase<'a> {
    /// Drives the call until it has its answer, or must wait. Each arm takes the phase
    /// out, and puts back the one it waits in.
    fn advance(
        &mut self,
        settings: &'a Settings,
        cx: &mut Context<'_>,
        body: &mut dyn Body,
    ) -> Poll<Step> {
        loop {
            match mem::replace(self, Phase::Done) {
                Phase::Start {
                    store,
                    derived,
                    looked,
                } => match derived {
                    Err(err) => return Poll::Ready(Step::Failed(err)),
                    Ok(None) => {
                        unkeyed();
                        *self = Phase::Unkeyed;
                    }
                    // A record in memory is replayed at once: no future, no allocation.
                    Ok(Some((key, fingerprint))) => {
                        let at_once = (!looked).then(|| {
                            settings.replay_at_once(store.get(), &key, fingerprint.as_ref())
                        });
                        match at_once.flatten() {
                            Some(Ok(found)) => return Poll::Ready(Step::Replay(found)),
                            Some(Err(err)) => return Poll::Ready(Step::Failed(err)),
                            None => {
                                let begin = settings.begin(store, key, fingerprint);
                                *self = Phase::Begin(Box::pin(begin));
                            }
                        }
                    }
                },
                Phase::Begin(mut begin) => match begin.as_mut().poll(cx) {
                    Poll::Pending => {
                        *self = Phase::Begin(begin);
                        return Poll::Pending;
                    }
                    Poll::Ready(Ok(Begun::Run(held))) => *self = Phase::Running(held, None),
                    Poll::Ready(Ok(Begun::Replay(record))) => {
                        return Poll::Ready(Step::Replay(Found::Encoded(record, None)))
                    }
                    Poll::Ready(Err(err)) => return Poll::Ready(Step::Failed(err)),
                },
                Phase::Unkeyed => {
                    if attempt::sync_scope_unkeyed(|| body.poll_body(cx)).is_pending() {
                        *self = Phase::Unkeyed;
                        return Poll::Pending;
                    }
                    return Poll::Ready(Step::Executed { replayed: false });
                }
                Phase::Running(held, mut heartbeat) => {
                    let polled = held.poll_body(cx, &mut heartbeat, &mut |cx| body.poll_body(cx));
                    if polled.is_pending() {
                        *self = Phase::Running(held, heartbeat);
                        return Poll::Pending;
                    }
                    let ending = body.ending(held.keeps_typed());
                    let reconciled = held.reconciled();
                    *self = Phase::Ending(Box::pin(held.end(ending, settings.ttl)), reconciled);
                }
                Phase::Ending(mut end, reconciled) => match end.as_mut().poll(cx) {
                    Poll::Pending => {
                        *self = Phase::Ending(end, reconciled);
                        return Poll::Pending;
                    }
                    Poll::Ready(Verdict::Own) => {
                        return Poll::Ready(Step::Executed {
                            replayed: reconciled,
                        })
                    }
                    Poll::Ready(Verdict::Failed(err)) => return Poll::Ready(Step::Failed(err)),
                },
                Phase::Done => panic!("an idempotent call was polled after it returned"),
            }
        }
    }
}

/// The log of a call without a key (an absent optional key): its body runs with no claim.
pub(crate) fn unkeyed() {
    tracing::debug!(outcome = "unkeyed", "no key: the body ran without a claim");
}
