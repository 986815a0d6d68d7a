//! Runnable example programs: `cargo run -p idem-examples --example <name>` from the workspace root.
//!
//! The repository README is this crate's documentation too, so that every Rust block in it
//! is compiled (and run, unless marked `no_run`) by `cargo test`.
#![doc = include_str!("../README.md")]
