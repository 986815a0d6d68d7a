//! The outcome nobody knows: a call that took its key over from a claim whose holder's
//! lease ran out while its body ran (its process died or stalled) cannot tell from the
//! store whether that body's effect happened. [`reconcile`] asks the destination instead,
//! once, before the body.

use std::future::Future;

use super::attempt::{self, Doubt, Place};
use crate::Error;

/// Asks the destination of the body's effect whether an earlier, unfinished attempt of this
/// call already had it, when, and only when, that cannot be known otherwise: this call's
/// claim took the key over from a claim that was never settled (its holder's lease ran out
/// while its body ran, because its process died or stalled, or an operator released it).
/// Call it first in the body; `lookup` is polled only then.
///
/// - `Ok(Some(value))`: the effect happened. Return `value`: it is recorded as the call's
///   result and answered as a replay ([`Outcome::Replayed`](crate::Outcome::Replayed)).
/// - `Ok(None)`, and always when the key was not taken over (a fresh key, a key released
///   by an `Err`, an expired record) or in a call without a key: the body goes on as on a
///   fresh key.
/// - `Err(err)`: the destination could not say. The body should return the error; the key
///   is then not released but left to lapse at the end of its lease, so that the next
///   attempt asks again.
///
/// The doubt lasts until it is settled: a body of a call that took its key over, and ends
/// without a value (an error, a panic, a cancellation) before `reconcile` said the effect
/// was not there, leaves its claim to lapse rather than releasing it, whether it asked or
/// not, so that no later attempt runs the body unwarned.
///
/// The lookup runs under the call's claim, renewed as the body's time is, and its value is
/// recorded by the claim's token: a call whose claim was taken over meanwhile records
/// nothing. The attribute's `reconcile = …` is this, before the body.
///
/// ```
/// use idem_runtime::{reconcile, MemoryStore, Operation};
///
/// # async fn find_credit(_: &str) -> Result<Option<u64>, idem_runtime::Error> { Ok(None) }
/// # async fn credit(_: &str) -> Result<u64, idem_runtime::Error> { Ok(7) }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::Error> {
/// let store = MemoryStore::new();
/// let op = Operation::new("ledger.credit.v1");
/// let key = op.key(&"evt_1")?;
/// let credited = op
///     .run(&store, &key, None, async {
///         // Only after a holder died mid-body: did its credit land?
///         if let Some(credit) = reconcile(find_credit("evt_1")).await? {
///             return Ok(credit);
///         }
///         credit("evt_1").await
///     })
///     .await?;
/// assert_eq!(credited.into_inner(), 7);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// `lookup`'s own errors, and [`Error::Config`] (converted with `E: From<Error>`) when it
/// is called outside every idempotent call's body.
pub async fn reconcile<T, E, F>(lookup: F) -> Result<Option<T>, E>
where
    E: From<Error>,
    F: Future<Output = Result<Option<T>, E>>,
{
    let attempt = match attempt::place() {
        Place::Outside => {
            return Err(Error::config(
                "`reconcile(…)` ran outside every idempotent call: call it first in the body of an `#[idempotent]` function or of `Operation::run`, whose claim tells whether it took an unfinished call over",
            )
            .into())
        }
        Place::Unkeyed => return Ok(None),
        Place::Claimed(attempt) => attempt,
    };
    if !attempt.resolve(Doubt::Unknown, Doubt::Asking) {
        // A fresh key, or asked already in this attempt.
        return Ok(None);
    }
    tracing::info!(
        outcome = "reconciling",
        "the key was taken over from a claim whose body may have run: asking its destination"
    );
    let found = lookup.await?;
    match &found {
        Some(_) => {
            attempt.resolve(Doubt::Asking, Doubt::Found);
            tracing::info!(
                outcome = "reconciled",
                "the destination has the effect: its value is recorded, the body does not run"
            );
        }
        None => {
            attempt.resolve(Doubt::Asking, Doubt::Absent);
            tracing::info!(
                outcome = "reconciled",
                "the destination has no effect: the body runs"
            );
        }
    }
    Ok(found)
}

/// The expansion's `reconcile = …`: `Some` of what the function returns when the lookup
/// answered it (its value, or its error), `None` when the body runs.
#[doc(hidden)]
pub async fn reconciled<R, F>(lookup: F) -> Option<R>
where
    R: super::IdemResult,
    R::Err: From<Error>,
    F: Future<Output = Result<Option<R::Ok>, R::Err>>,
{
    match reconcile(lookup).await {
        Ok(Some(value)) => Some(R::from_result(Ok(value))),
        Ok(None) => None,
        Err(err) => Some(R::from_result(Err(err))),
    }
}
