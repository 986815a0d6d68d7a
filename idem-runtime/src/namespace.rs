//! An operation's name, as the engine keeps it and the meter labels it.

use std::borrow::Cow;
use std::sync::Arc;

/// An operation's name: a static string, or a shared one, so that cloning an operation (as
/// every spawned body does) never allocates.
#[derive(Clone)]
pub(crate) enum Namespace {
    Static(&'static str),
    Shared(Arc<str>),
}

impl From<Cow<'static, str>> for Namespace {
    fn from(name: Cow<'static, str>) -> Self {
        match name {
            Cow::Borrowed(name) => Self::Static(name),
            Cow::Owned(name) => Self::Shared(name.into()),
        }
    }
}

impl Namespace {
    /// The namespace as a metric label, without copying it.
    #[cfg(feature = "metrics")]
    pub(crate) fn label(&self) -> ::metrics::SharedString {
        match self {
            Self::Static(name) => ::metrics::SharedString::const_str(name),
            Self::Shared(name) => ::metrics::SharedString::from_shared(Arc::clone(name)),
        }
    }

    /// Whether `other` is this very name: the same static string, or the same shared one.
    /// Equal names held apart are not; a cache keyed by names can only miss on them.
    #[cfg(feature = "metrics")]
    pub(crate) fn is(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Static(a), Self::Static(b)) => std::ptr::eq(*a, *b),
            (Self::Shared(a), Self::Shared(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Where the name's bytes are, to spread names over a cache's slots.
    #[cfg(feature = "metrics")]
    pub(crate) fn address(&self) -> usize {
        let address = self.as_ptr() as usize;
        address ^ (address >> 7) ^ (address >> 13)
    }
}

impl std::fmt::Debug for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&**self, f)
    }
}

impl std::ops::Deref for Namespace {
    type Target = str;

    fn deref(&self) -> &str {
        match self {
            Self::Static(name) => name,
            Self::Shared(name) => name,
        }
    }
}
