//! The bounds on an `#[idempotent]` function's types, each with a message of its own.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::Error;

/// What an `#[idempotent]` function's `Ok` type must be: one bound, with one message, for
/// the two serde traits the record needs.
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` records the `Ok` value, so `{Self}` must be `Serialize` and `Deserialize`",
    label = "`{Self}` is not `Serialize + Deserialize`",
    note = "derive both: `#[derive(serde::Serialize, serde::Deserialize)]`; the value is recorded with serde_json and replayed to every retry"
)]
pub trait Recordable: Serialize + DeserializeOwned {}

#[diagnostic::do_not_recommend]
impl<T: Serialize + DeserializeOwned> Recordable for T {}

/// What an `#[idempotent]` function's error type must be: convertible from the runtime's
/// errors, which the call returns through it (a store that is down, a reused key).
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` returns its own errors through `{Self}`, so it needs `impl From<idem_runtime::Error> for {Self}`",
    label = "`{Self}` has no `From<idem_runtime::Error>`",
    note = "add a variant for them, e.g. `Idem(idem_runtime::Error)`, and `impl From<idem_runtime::Error>` that wraps it (or use `idem_runtime::Error` itself as the error type)"
)]
pub trait FromIdemError: From<Error> {}

#[diagnostic::do_not_recommend]
impl<E: From<Error>> FromIdemError for E {}

/// Checks a `cache_err` predicate where it is written: its error type must be serializable.
pub fn cache_err<E>(is_final: fn(&E) -> bool) -> fn(&E) -> bool
where
    E: Serialize + DeserializeOwned,
{
    is_final
}
