//! The first examples, on the embedded store: `cargo run --example quickstart` and
//! `cargo run --example payments` from the workspace root. They live in a package of their
//! own so that they build only what they need; the examples with Redis, PostgreSQL, HTTP and
//! NATS are in `idem-examples`.
