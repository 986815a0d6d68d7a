//! The `#[idempotent]` attribute. Use it through `idem_runtime::idempotent`.
