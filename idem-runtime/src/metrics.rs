//! Counts and claim latency through the [`metrics`](https://docs.rs/metrics) facade
//! (feature `metrics`): install any recorder (`metrics-exporter-prometheus`, …) and these
//! appear, labelled with the operation's `namespace`.
//!
//! | name | kind | labels | what it counts |
//! |---|---|---|---|
//! | `idem_calls_total` | counter | `namespace`, `outcome` | keyed calls, by how they ended (below) |
//! | `idem_claim_duration_seconds` | histogram | `namespace` | from the start of a call until it held the claim or had a record to replay, waits included; a replay answered at once from memory (the memory store) counts as 0 s, since it takes a fraction of a microsecond and timing it would cost more than the replay |
//!
//! | `outcome` | when |
//! |---|---|
//! | `executed` | the body ran and its result (or a final error, with `cache_err`) is recorded |
//! | `replayed` | a recorded result was replayed, including one shared by a concurrent call |
//! | `released` | the body ran and the claim was released: an error, a panic, a cancelled call, a result that cannot be recorded |
//! | `rejected` | the key was in progress: `in_flight = "reject"`, a wait that timed out, or a call waiting for its own enclosing call |
//! | `mismatched` | the key was used with a different payload (`422` over HTTP) |
//!
//! A store error is none of these: it is logged, and the call fails with
//! [`Error::Store`](crate::Error::Store). Calls without a key (an absent optional key) are not
//! counted. The HTTP layer's calls are counted under its namespace (`http` by default).
//!
//! ```
//! use idem_runtime::metrics::{CALLS, CLAIM_DURATION};
//!
//! assert_eq!(CALLS, "idem_calls_total");
//! assert_eq!(CLAIM_DURATION, "idem_claim_duration_seconds");
//! ```

/// The counter of keyed calls, labelled `namespace` and `outcome`.
pub const CALLS: &str = "idem_calls_total";

/// The histogram of claim latency in seconds, labelled `namespace`.
pub const CLAIM_DURATION: &str = "idem_claim_duration_seconds";
