//! Whether a replay may hand back the value itself: a probe of the return type.

use std::marker::PhantomData;

use crate::engine::{IdemResult, Typing};

/// Asks, where the function's return type `R` is known, whether its success type can be
/// kept and replayed as itself (it is `Clone`): `(&TypeProbe::<R>::new()).__idem_typing()`
/// is a [`Typing`] then, through [`TypedByClone`], and a [`NoTyping`] otherwise, through
/// [`TypedByCodec`] (the method that needs one autoref fewer wins where its bounds hold).
pub struct TypeProbe<R>(PhantomData<fn() -> R>);

impl<R> TypeProbe<R> {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

/// A success type that is replayed by decoding its record.
pub struct NoTyping;

pub trait TypedByClone {
    type Typing;
    fn __idem_typing(&self) -> Self::Typing;
}

impl<R> TypedByClone for TypeProbe<R>
where
    R: IdemResult,
    R::Ok: Clone + Send + Sync + 'static,
{
    type Typing = Typing<R::Ok>;
    fn __idem_typing(&self) -> Typing<R::Ok> {
        Typing::cloned()
    }
}

pub trait TypedByCodec {
    fn __idem_typing(&self) -> NoTyping;
}

impl<R> TypedByCodec for &TypeProbe<R> {
    fn __idem_typing(&self) -> NoTyping {
        NoTyping
    }
}

/// What [`run`](super::run::run) takes of a probe's answer.
pub trait IntoTyping<T> {
    fn into_typing(self) -> Option<Typing<T>>;
}

impl<T> IntoTyping<T> for NoTyping {
    fn into_typing(self) -> Option<Typing<T>> {
        None
    }
}

impl<T> IntoTyping<T> for Typing<T> {
    fn into_typing(self) -> Option<Typing<T>> {
        Some(self)
    }
}
