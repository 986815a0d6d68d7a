//! Resumable steps: the effects of a body recorded one by one, so that a later attempt of
//! the same call replays the steps that finished and runs the first one that did not.
//!
//! A step is an idempotent call of its own, run by the same engine: its key is derived from
//! the enclosing call's key, its fingerprint, the step's name and its occurrence, and it is
//! claimed, recorded and replayed in the enclosing call's store with the enclosing call's
//! lease and TTL. What makes it a *step* is the fence around its record: it is recorded
//! only while the enclosing claim is confirmed held, so that a holder whose key was taken
//! over cannot record a step the new holder would then replay.

use std::future::Future;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::attempt::{self, Attempt, Place};
use super::{Operation, Outcome};
use crate::codec::Json;
use crate::{Error, Fingerprint, Key, Store};

/// The key of occurrence `occurrence` of step `name` in the call of `call`, claimed with
/// `fingerprint`: a sha256 digest of all four, apart from every key [`Key::derive`] makes.
fn step_key(call: &Key, fingerprint: Option<&Fingerprint>, name: &str, occurrence: u32) -> Key {
    let mut digest = Sha256::new();
    digest.update(b"idem.step\0");
    digest.update(call.as_bytes());
    match fingerprint {
        Some(fingerprint) => {
            digest.update([1]);
            digest.update(fingerprint.as_bytes());
        }
        None => digest.update([0]),
    }
    digest.update((name.len() as u64).to_be_bytes());
    digest.update(name.as_bytes());
    digest.update(occurrence.to_be_bytes());
    Key::from_bytes(digest.finalize().into())
}

/// Runs `future` as a recorded step of the idempotent call whose body this is: on a later
/// attempt of the same call (after a crash, a lost lease, or an `Err` that released the
/// key), a step that finished replays its recorded value without running its future, and
/// the first step that did not finish runs.
///
/// ```
/// use idem_runtime::{step, MemoryStore, Operation};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::Error> {
/// let store = MemoryStore::new();
/// let checkout = Operation::new("shop.checkout.v1");
/// let key = checkout.key(&"order-7")?;
/// let charges = std::sync::atomic::AtomicU32::new(0);
/// let charge = || async {
///     charges.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
///     Ok::<_, idem_runtime::Error>("ch_1".to_string())
/// };
///
/// // The first attempt charges, then fails: the key is released, the charge is recorded.
/// let first = checkout
///     .run(&store, &key, None, async {
///         let charge = step("charge", charge()).await?;
///         Err::<String, _>(idem_runtime::Error::store("the order table is down"))
///             .map(|_: String| charge)
///     })
///     .await;
/// assert!(first.is_err());
///
/// // The retry replays the charge and finishes.
/// let receipt = checkout
///     .run(&store, &key, None, async {
///         let charge = step("charge", charge()).await?;
///         Ok::<_, idem_runtime::Error>(format!("receipt for {charge}"))
///     })
///     .await?;
/// assert_eq!(receipt.into_inner(), "receipt for ch_1");
/// assert_eq!(charges.load(std::sync::atomic::Ordering::SeqCst), 1);
/// # Ok(())
/// # }
/// ```
///
/// - **Naming.** A step is known by its `name` and its occurrence: a name used in a loop is
///   `name#0`, `name#1`, … in the order the steps are *created* (the call of `step`, not its
///   first poll), so steps joined concurrently are numbered as written. A retry must create
///   the same steps in the same order; a body that changes its steps between attempts runs
///   the ones whose names and occurrences are new. The enclosing call's fingerprint is part
///   of every step's key: a retry with another payload replays none of the first one's
///   steps.
/// - **What is recorded.** A step's `Ok` value (with `serde_json`), in the enclosing call's
///   store, for its TTL; an `Err` is not recorded (the next attempt runs the step again).
///   The records are left to expire with the call's TTL rather than removed when the call
///   completes: a holder whose key was taken over and that reaches a step after the new
///   holder finished then replays it instead of running its effect again.
/// - **Fenced.** A step is recorded only after the enclosing claim is confirmed held (one
///   renewal of it, which the store answers atomically), and does not start when this
///   process knows the claim lost. A holder whose key was taken over gets an
///   [`Error::Store`] from `step` instead of a record.
/// - **Inside a step**, [`attempt()`](crate::attempt()) is the step's own: its
///   [`key`](crate::Attempt::key) is deterministic (the same on every attempt of the call),
///   the key to send downstream (`Idempotency-Key`) so that the next service dedupes the
///   step too; its [`token`](crate::Attempt::token) fences the step's writes.
/// - **What a step does not promise:** if the process dies after the step's effect and
///   before its record, the next attempt runs the step's future again. The downstream key
///   is what makes that safe.
/// - **Where it runs.** In the body of a call that holds its key, on every store, and in a
///   `transaction =` body (where the transaction already makes the database writes
///   atomic; steps are for the effects outside it). In the body of a call whose optional
///   key is `None`, a step is a plain future. Outside every idempotent call it is an
///   [`Error::Config`], never run unprotected. Tasks spawned by the body are outside it.
///
/// # Errors
///
/// `future`'s own errors, and [`Error`]s converted with `E: From<Error>`: [`Error::Config`]
/// outside an idempotent call, [`Error::Store`] when the store fails or the enclosing claim
/// was taken over, [`Error::InProgress`] when a step is held by another holder past the
/// lease, and [`Error::Codec`] for a recorded value that does not decode.
pub fn step<T, E, F>(name: &str, future: F) -> impl Future<Output = Result<T, E>> + use<T, E, F>
where
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: Future<Output = Result<T, E>>,
{
    // Placed and numbered now, when the step is created, not when it is first polled.
    let place = match attempt::place() {
        Place::Outside => Err(name.to_owned()),
        Place::Unkeyed => Ok(None),
        Place::Claimed(attempt) => {
            let journal = attempt.journal();
            let occurrence = journal.occurrence(name);
            let key = step_key(
                attempt.key(),
                journal.fingerprint.as_ref(),
                name,
                occurrence,
            );
            let operation = journal.operation(name);
            Ok(Some((attempt, key, operation)))
        }
    };
    async move {
        match place {
            Err(name) => Err(Error::config(format!(
                "`step(\"{name}\", …)` ran outside every idempotent call: call it in the body of an `#[idempotent]` function or of `Operation::run`, whose claim records it"
            ))
            .into()),
            Ok(None) => future.await,
            Ok(Some((attempt, key, operation))) => recorded(&attempt, key, &operation, future).await,
        }
    }
}

/// A step of the call `attempt`, run or replayed as `operation` under `key`.
async fn recorded<T, E, F>(
    attempt: &Attempt,
    key: Key,
    operation: &Operation,
    future: F,
) -> Result<T, E>
where
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: Future<Output = Result<T, E>>,
{
    let journal = attempt.journal();
    let holder = journal.holder.as_deref();
    if let Some(holder) = holder.filter(|holder| holder.in_doubt()) {
        holder.confirm().await?;
    }
    let body = async {
        let value = future.await?;
        if let Some(holder) = holder {
            holder.confirm().await?;
        }
        Ok(value)
    };
    operation
        .call::<Json, Arc<dyn Store>, Result<T, E>, _, _>(
            &journal.store,
            Ok(Some((key, None))),
            body,
            |outcome| outcome,
        )
        .await
        .map(Outcome::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_keys_differ_by_call_payload_name_and_occurrence() {
        let call = Key::derive("steps", &1).unwrap();
        let other = Key::derive("steps", &2).unwrap();
        let payload = Fingerprint::of(&"a").unwrap();
        let base = step_key(&call, Some(&payload), "charge", 0);
        assert_eq!(base, step_key(&call, Some(&payload), "charge", 0));
        for differs in [
            step_key(&other, Some(&payload), "charge", 0),
            step_key(&call, None, "charge", 0),
            step_key(&call, Some(&Fingerprint::of(&"b").unwrap()), "charge", 0),
            step_key(&call, Some(&payload), "charges", 0),
            step_key(&call, Some(&payload), "charge", 1),
        ] {
            assert_ne!(base, differs);
        }
        // A name's length is part of the digest: ("ab", 0) and ("a", …) cannot collide by
        // shifting bytes between the name and the occurrence.
        assert_ne!(
            step_key(&call, None, "a", 0x6200_0000),
            step_key(&call, None, "ab", 0)
        );
    }
}
