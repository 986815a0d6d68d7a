//! Resumable steps: the effects of a body recorded one by one, so that a later attempt of
//! the same call replays the steps that finished and runs the first one that did not.
//!
//! A step takes no claim of its own: the call's claim already makes its holder the only
//! one running the body. A step that runs costs one round trip, its record, written by
//! [`Store::record_step`](crate::Store::record_step) in one conditional write that lands only while the call's claim
//! is still this holder's, so a holder that lost the key can never leave a record the new
//! holder would replay. An attempt reads every step recorded before it in one round trip,
//! when its first step asks. Before a step's future is first polled, the holder checks its
//! lease by its own clock, after every round trip that came before, and asks the store
//! when less than a quarter of it is left.

use std::future::Future;

use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::attempt::{self, Attempt, Place};
use crate::codec::{self, Json, ReleaseErrors, ValueCodec};
use crate::{Error, Fingerprint, Key};

/// The key of occurrence `occurrence` of step `name` in the body of `parent` (the call, or
/// the step a step runs in), whose call is `call` and was claimed with `fingerprint`: the
/// call key's first 16 bytes (so that a store finds a call's steps in one range of keys),
/// then 16 bytes of a sha256 digest of the rest, apart from every key [`Key::derive`]
/// makes.
fn step_key(
    call: &Key,
    parent: &Key,
    fingerprint: Option<&Fingerprint>,
    name: &str,
    occurrence: u32,
) -> Key {
    let mut digest = Sha256::new();
    digest.update(b"idem.step\0");
    digest.update(parent.as_bytes());
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
    let mut key = [0; 32];
    key[..16].copy_from_slice(&call.as_bytes()[..16]);
    key[16..].copy_from_slice(&digest.finalize()[..16]);
    Key::from_bytes(key)
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
///   the ones whose names and occurrences are new. **Name a step by what it does to what**
///   (`step(&format!("charge:{card}"), …)`), not by its place: a deploy that removes one of
///   two steps named `"charge"` shifts the occurrences, and the new code's first
///   `"charge"` would replay the old second one. The occurrence is part of the step's
///   [`attempt().key()`](crate::Attempt::key), so two steps of one name send different
///   downstream keys. The enclosing call's fingerprint is part of every step's key: a retry
///   with another payload replays none of the first one's steps.
/// - **What is recorded.** A step's `Ok` value (with `serde_json`), in the enclosing call's
///   store, for the call's TTL; an `Err` is not recorded (the next attempt runs the step
///   again). The records outlive the call's own record, so that a holder whose key was
///   taken over and that reaches a step after the new holder finished replays it instead of
///   running its effect again; [`Store::remove`](crate::Store::remove) of the call's key
///   removes its steps too (a reset of the call, steps and all). A value whose encoding
///   does not decode back as its type (a NaN) is recorded as gone: the body gets it, a
///   later attempt that reaches the step gets [`Error::Gone`]. `step` cannot see types
///   that JSON flattens: `Option<Option<T>>` replays `Some(None)` as `None`; wrap such a
///   value in a struct or an enum.
/// - **Fenced by construction.** A step's record is one conditional write
///   ([`Store::record_step`](crate::Store::record_step)) that lands only while the call's
///   claim is held under this holder's token with a live lease, by the store's clock. A
///   holder whose key was taken over (or whose lease lapsed) gets an
///   [`Error::Unrecorded`] instead (its step ran; its record is not written), and the new
///   holder never replays what it ran. Before a step's future is
///   first polled, the holder checks its lease by its own clock, after every round trip
///   that came before: with less than a quarter of it left, it renews first, and does not
///   start the step if the store does not confirm in time.
/// - **What a step does not promise:** if the process dies (or freezes past its lease)
///   after the step's effect and before its record, the next attempt runs the step's
///   future again; an effect the process was inside when it froze may land after the new
///   holder took over. The downstream key (`attempt().key()`, the same on every attempt)
///   is what makes that safe.
/// - **Cost.** A step that runs is one round trip (its record), two when the lease must be
///   confirmed first; an attempt reads every recorded step in one round trip, when its
///   first step asks; a step that replays costs nothing more.
/// - **Inside a step**, [`attempt()`](crate::attempt()) is the step's own: its
///   [`key`](crate::Attempt::key) is deterministic (the same on every attempt of the call),
///   the key to send downstream (`Idempotency-Key`) so that the next service dedupes the
///   step too; its [`token`](crate::Attempt::token) is the call's fencing token.
/// - **In a `transaction =` body** a step runs with its own `attempt()`, and is **not
///   recorded**: the call's claim there is an uncommitted row that no other connection can
///   see, so no write outside the transaction can be fenced by it (and SQLite's file lock,
///   held by the transaction, lets no other connection write at all), while a record
///   inside it would commit with the call's own record, which replays first, or roll back
///   with the attempt. An attempt that rolls back runs its steps again on the retry, under
///   the same `attempt().key()`: send it downstream.
/// - **Where else it runs.** In the body of a call whose optional key is `None`, a step is
///   a plain future. Outside every idempotent call it is an [`Error::Config`], never run
///   unprotected. Tasks spawned by the body are outside it. A step on a store that does not
///   record steps (a third-party store without
///   [`Store::record_step`](crate::Store::record_step)) is an [`Error::Config`] before it
///   runs.
///
/// # Errors
///
/// `future`'s own errors, and [`Error`]s converted with `E: From<Error>`: [`Error::Config`]
/// outside an idempotent call or on a store without step records, [`Error::Store`] when
/// the store fails or the enclosing claim is no longer held before the step starts (it did
/// not run), [`Error::Unrecorded`] when the step ran and its record could not be written
/// (the claim was lost meanwhile, or the store failed until the lease ran out), [`Error::Gone`] for a step
/// whose value could not be recorded as itself, and [`Error::Codec`] for a recorded value
/// that no longer decodes as `T`.
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
                &journal.call,
                attempt.key(),
                journal.fingerprint.as_ref(),
                name,
                occurrence,
            );
            Ok(Some((attempt, key)))
        }
    };
    async move {
        match place {
            Err(name) => Err(Error::config(format!(
                "`step(\"{name}\", …)` ran outside every idempotent call: call it in the body of an `#[idempotent]` function or of `Operation::run`, whose claim records it"
            ))
            .into()),
            Ok(None) => future.await,
            Ok(Some((attempt, key))) => recorded(&attempt, key, future).await,
        }
    }
}

/// Step `key` of the call `attempt`: replayed if an earlier attempt recorded it, otherwise
/// run under its own attempt and recorded.
async fn recorded<T, E, F>(attempt: &Attempt, key: Key, future: F) -> Result<T, E>
where
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: Future<Output = Result<T, E>>,
{
    let journal = attempt.journal();
    let step = attempt.step(key);
    let Some(holder) = journal.holder.as_deref() else {
        // In the caller's transaction: run, not recorded (see `step`).
        return step.scope(future).await;
    };
    if let Some(record) = journal.recorded(holder).await?.get(&key) {
        // A step records no error: `ReleaseErrors` refuses an error's record as a codec error.
        return match codec::decode::<Json, T, (), _>(record, &ReleaseErrors)? {
            Ok(value) => Ok(value),
            Err(()) => Err(Error::codec("a step's record holds an error").into()),
        };
    }
    holder.vouch().await?;
    let value = step.scope(future).await?;
    // The step ran: a record that cannot be written says so, never that nothing happened.
    holder
        .record_step(&key, <Json as ValueCodec<T>>::record(&value)?, journal.ttl)
        .await
        .map_err(|err| Error::Unrecorded(Box::new(err)))?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_keys_differ_by_call_payload_name_and_occurrence() {
        let call = Key::derive("steps", &1).unwrap();
        let other = Key::derive("steps", &2).unwrap();
        let payload = Fingerprint::of(&"a").unwrap();
        let key = |parent: &Key, fingerprint: Option<&Fingerprint>, name: &str, n: u32| {
            step_key(&call, parent, fingerprint, name, n)
        };
        let base = key(&call, Some(&payload), "charge", 0);
        assert_eq!(base, key(&call, Some(&payload), "charge", 0));
        for differs in [
            step_key(&other, &other, Some(&payload), "charge", 0),
            key(&base, Some(&payload), "charge", 0),
            key(&call, None, "charge", 0),
            key(&call, Some(&Fingerprint::of(&"b").unwrap()), "charge", 0),
            key(&call, Some(&payload), "charges", 0),
            key(&call, Some(&payload), "charge", 1),
        ] {
            assert_ne!(base, differs);
        }
        // A name's length is part of the digest: ("ab", 0) and ("a", …) cannot collide by
        // shifting bytes between the name and the occurrence.
        assert_ne!(
            key(&call, None, "a", 0x6200_0000),
            key(&call, None, "ab", 0)
        );
        // Every step of a call, nested ones too, starts with the call key's first 16 bytes.
        for step in [base, key(&base, None, "nested", 0)] {
            assert_eq!(step.as_bytes()[..16], call.as_bytes()[..16]);
            assert_ne!(step, call);
        }
    }
}
