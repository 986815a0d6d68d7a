//! [`Outcome`]: a call's value, and whether it ran here or was recorded before.

/// The result of an idempotent call, and whether it ran here or was recorded before.
///
/// Services that answer HTTP use [`is_replayed`](Outcome::is_replayed) to set a replay
/// header such as `Idempotent-Replayed: true`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Outcome<T> {
    /// This call ran the body.
    Executed(T),
    /// The body ran in an earlier (or concurrent) call; this is its recorded result.
    Replayed(T),
}

impl<T> Outcome<T> {
    /// The value, however it was obtained.
    pub fn into_inner(self) -> T {
        match self {
            Self::Executed(value) | Self::Replayed(value) => value,
        }
    }

    /// A reference to the value.
    pub fn get(&self) -> &T {
        match self {
            Self::Executed(value) | Self::Replayed(value) => value,
        }
    }

    /// Whether the value was recorded by an earlier or concurrent call.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Self::Replayed(_))
    }

    /// The same outcome of another value: how a handler turns a recorded value into its
    /// answer and keeps whether it was replayed
    /// (`outcome.map(|receipt| (StatusCode::CREATED, Json(receipt)))`).
    ///
    /// ```
    /// use idem_runtime::Outcome;
    ///
    /// let outcome = Outcome::Replayed(7).map(|n| n * 6);
    /// assert_eq!(outcome, Outcome::Replayed(42));
    /// ```
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Outcome<U> {
        match self {
            Self::Executed(value) => Outcome::Executed(f(value)),
            Self::Replayed(value) => Outcome::Replayed(f(value)),
        }
    }
}
