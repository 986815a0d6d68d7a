//! Runnable example programs: `cargo run -p idem-examples --example <name>` from the workspace root.
//!
//! The repository README is this crate's documentation too, and so are the pages of
//! `idem_runtime::guide`, so that every Rust block in them is compiled (and run, unless
//! marked `no_run`) by `cargo test`, with the dependencies of every feature.
#![doc = include_str!("../README.md")]

/// `idem_runtime::guide::keys`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/keys.md"))]
pub mod guide_keys {}

/// `idem_runtime::guide::leases`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/leases.md"))]
pub mod guide_leases {}

/// `idem_runtime::guide::stores`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/stores.md"))]
pub mod guide_stores {}

/// `idem_runtime::guide::transactions`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/transactions.md"))]
pub mod guide_transactions {}

/// `idem_runtime::guide::http`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/http.md"))]
pub mod guide_http {}

/// `idem_runtime::guide::client`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/client.md"))]
pub mod guide_client {}

/// `idem_runtime::guide::steps`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/steps.md"))]
pub mod guide_steps {}

/// `idem_runtime::guide::queues`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/queues.md"))]
pub mod guide_queues {}

/// `idem_runtime::guide::what_happens_when`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/what-happens-when.md"))]
pub mod guide_what_happens_when {}

/// `idem_runtime::guide::failure_model`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/failure-model.md"))]
pub mod guide_failure_model {}

/// `idem_runtime::guide::guarantees`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/guarantees.md"))]
pub mod guide_guarantees {}

/// `idem_runtime::guide::reliability`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/reliability.md"))]
pub mod guide_reliability {}

/// `idem_runtime::guide::expansion`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/expansion.md"))]
pub mod guide_expansion {}

/// `idem_runtime::guide::operations`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/operations.md"))]
pub mod guide_operations {}

/// `idem_runtime::guide::decisions`: its examples, compiled as this crate's doctests.
#[cfg_attr(doctest, doc = include_str!("../idem-runtime/guide/decisions.md"))]
pub mod guide_decisions {}
