//! Runnable example programs: `cargo run --example <name>` from the workspace root.
