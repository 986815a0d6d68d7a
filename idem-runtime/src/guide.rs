//! The operator's guide: what idem promises, what it costs, and how to run it.
//!
//! - [`keys`]: keys and fingerprints, what goes in each, and the mistakes that make a retry
//!   run twice or replay the wrong result.
//! - [`leases`]: how long a lease and a TTL should be, and how they fit a client's retry
//!   budget.
//! - [`stores`]: choosing a store, and how each one claims, waits, fails and is tested.
//! - [`transactions`]: exactly-once effects, the claim in the caller's own transaction, and
//!   fencing downstream writes with the attempt's token.
//! - [`http`]: the `Idempotency-Key` header on the server.
//! - [`client`]: the client's half: keys, retries and their budget.
//! - [`steps`]: a body that resumes where a crash left off.
//! - [`queues`]: consumers of at-least-once brokers, and how long a record must last.
//! - [`operations`]: what an operator sees of a store and does to it safely (feature
//!   `admin`): stuck keys, dead holders, re-running a call, runbooks.
//! - [`what_happens_when`]: a body fails, a caller is cancelled, a process crashes, a
//!   completion is refused, a store goes away.
//! - [`failure_model`]: what each store promises when things break, measured: crashes,
//!   restarts, failovers, partitions between hosts.
//! - [`guarantees`]: every guarantee, and the test that fails if it breaks.
//! - [`reliability`]: the error table checked on histories of calls under seeded faults, and
//!   the soak's figures.
//! - [`expansion`]: what `#[idempotent]` writes, exactly.
//! - [`decisions`]: where the design had to choose, and why it chose as it did.
//!
//! Every figure here comes with the command that reproduces it; the benchmarks, with their
//! baselines and floors, are in the repository's `BENCHMARKS.md`.
//!
//! The pages' examples use the crates of every feature (axum, hyper, reqwest, the AWS SDK):
//! they are compiled as doctests of the `idem-examples` crate, which has them all, and not
//! here (`cfg(doctest)` leaves the pages out of this crate's doctests).

#[cfg_attr(not(doctest), doc = include_str!("../guide/keys.md"))]
pub mod keys {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/leases.md"))]
pub mod leases {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/stores.md"))]
pub mod stores {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/transactions.md"))]
pub mod transactions {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/http.md"))]
pub mod http {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/client.md"))]
pub mod client {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/steps.md"))]
pub mod steps {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/queues.md"))]
pub mod queues {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/operations.md"))]
pub mod operations {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/what-happens-when.md"))]
pub mod what_happens_when {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/failure-model.md"))]
pub mod failure_model {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/guarantees.md"))]
pub mod guarantees {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/reliability.md"))]
pub mod reliability {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/expansion.md"))]
pub mod expansion {}

#[cfg_attr(not(doctest), doc = include_str!("../guide/decisions.md"))]
pub mod decisions {}
