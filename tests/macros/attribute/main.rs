//! `#[idempotent]` end to end: every argument, and every kind of function it supports.
//! The function shapes (free functions, methods, generics, namespaces, what the expansion
//! must survive) are in `shapes.rs`; the policies (`cache_err`, optional keys, `in_flight`,
//! `ttl`, `on_cancel`) in `policies.rs`.

mod policies;
mod shapes;

use std::sync::Arc;
use std::time::Duration;

use idem_runtime::{idempotent, Error, Fingerprint, MemoryStore};
use idem_tests::{Probe, Runs};
use serde::{Deserialize, Serialize};

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum AppError {
    Declined(String),
    Flaky,
    Idem(String),
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        match e {
            Error::PayloadMismatch => Self::Idem("mismatch".into()),
            Error::InProgress => Self::Idem("in progress".into()),
            other => Self::Idem(other.to_string()),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Request {
    id: u64,
    amount: u64,
    note: String,
}

fn store() -> MemoryStore {
    MemoryStore::new()
}
