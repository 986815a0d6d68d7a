//! The key and fingerprint of a call: `key = <expr>`, `fingerprint = <expr>`, and the checks on
//! their parts (a `HashSet` has no order to hash).

use serde::Serialize;

use crate::{Error, Fingerprint, Key, Operation};

/// The fingerprint of a `fingerprint = <expr>` value.
pub fn fingerprint<V: Serialize + ?Sized>(payload: &V) -> Result<Fingerprint, Error> {
    Fingerprint::of(payload)
}

/// A `key = <expr>` value, wrapped so that the two `__idem_key` methods below can tell an
/// `Option` apart at compile time: method resolution tries [`OptionalKey`] (on `KeyArg`)
/// before [`RequiredKey`] (on `&KeyArg`), and only an `Option` (or a reference to one) has
/// the former.
pub struct KeyArg<'a, T: ?Sized>(pub &'a T);

/// An optional key: `None` runs the body with no claim.
pub trait OptionalKey<'a> {
    /// The value to key on: the `Option` itself, or `None` when it is `None`.
    type Value: ?Sized;
    #[doc(hidden)]
    fn __idem_key(&self) -> Option<&'a Self::Value>;
}

impl<'a, T> OptionalKey<'a> for KeyArg<'a, Option<T>> {
    type Value = Option<T>;
    fn __idem_key(&self) -> Option<&'a Option<T>> {
        // Keyed on the `Option` itself, as before optional keys: recorded keys stay valid.
        self.0.as_ref().map(|_| self.0)
    }
}

impl<'a, T> OptionalKey<'a> for KeyArg<'a, &'a Option<T>> {
    type Value = Option<T>;
    fn __idem_key(&self) -> Option<&'a Option<T>> {
        KeyArg(*self.0).__idem_key()
    }
}

/// Every other key: always present.
pub trait RequiredKey<'a> {
    /// The value to key on.
    type Value: ?Sized;
    #[doc(hidden)]
    fn __idem_key(&self) -> Option<&'a Self::Value>;
}

impl<'a, T: ?Sized> RequiredKey<'a> for &KeyArg<'a, T> {
    type Value = T;
    fn __idem_key(&self) -> Option<&'a T> {
        Some(self.0)
    }
}

/// The key of a `key = <expr>` value, `None` for an absent optional key.
#[inline]
pub fn key<P, V: Serialize + ?Sized>(
    operation: &Operation<P>,
    value: Option<&V>,
) -> Result<Option<Key>, Error> {
    value.map(|value| operation.key(value)).transpose()
}

/// One part of a key or fingerprint value (the value itself, or an element of a tuple),
/// wrapped so that the two `__idem_order` methods below can tell a `HashSet` apart at
/// compile time: method resolution tries `Unordered` (on `KeyPart`) before `Ordered` (on
/// `&KeyPart`), and only a `HashSet` has the former.
pub struct KeyPart<'a, T: ?Sized>(pub &'a T);

/// What a `HashSet` part yields: refused by [`ordered`]. Generic over the set's elements
/// (see [`NeverInKey`]).
pub struct HashSetInKey<T>(std::marker::PhantomData<T>);

/// Chosen for `HashSet` parts.
pub trait Unordered<T> {
    #[doc(hidden)]
    fn __idem_order(&self) -> HashSetInKey<T> {
        HashSetInKey(std::marker::PhantomData)
    }
}

impl<T, S> Unordered<T> for KeyPart<'_, std::collections::HashSet<T, S>> {}
impl<T, S> Unordered<T> for KeyPart<'_, &std::collections::HashSet<T, S>> {}
impl<T, S> Unordered<T> for KeyPart<'_, &mut std::collections::HashSet<T, S>> {}

/// Chosen for every other part.
pub trait Ordered {
    #[doc(hidden)]
    fn __idem_order(&self) {}
}

impl<T: ?Sized> Ordered for &KeyPart<'_, T> {}

/// A key part whose encoding is the same in every process.
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` keys and fingerprints cannot hold a `HashSet`: its order differs from one process (and one call) to the next, so the call would never replay",
    label = "this is a `HashSet`",
    note = "use a `BTreeSet`, or a sorted `Vec`"
)]
pub trait DeterministicOrder {}

#[diagnostic::do_not_recommend]
impl DeterministicOrder for () {}

/// Never met: a `HashSet` part fails on it. Only through this bound, so that a part whose
/// type is unknown because of an earlier error (a misspelled field) leaves the bound
/// undecided, which the compiler does not report after that error, instead of refused.
pub trait NeverInKey {}

#[diagnostic::do_not_recommend]
impl<T: NeverInKey> DeterministicOrder for HashSetInKey<T> {}

/// Type-checks one key part (never called at run time).
pub fn ordered<O: DeterministicOrder>(_: O) {}
