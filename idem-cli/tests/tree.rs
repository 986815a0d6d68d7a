//! What `cargo install idem-cli --no-default-features --features redis` builds: neither the
//! AWS SDK nor sqlx (a Redis user's install stays small), as `cargo tree` resolves it from
//! the workspace's lockfile.

use std::process::Command;

/// The crates `idem-cli` with `features` depends on (normal and build dependencies, as an
/// install builds them), one name a line.
fn crates(features: &str) -> Vec<String> {
    let output = Command::new(env!("CARGO"))
        .args([
            "tree",
            "-p",
            "idem-cli",
            "--no-default-features",
            "--features",
            features,
            "-e",
            "normal,build",
            "--prefix",
            "none",
            "--format",
            "{p}",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    assert!(
        output.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
        .collect()
}

#[test]
fn a_redis_build_pulls_in_neither_the_aws_sdk_nor_sqlx() {
    let redis = crates("redis");
    assert!(redis.iter().any(|name| name == "redis"), "{redis:?}");
    let heavy: Vec<_> = redis
        .iter()
        .filter(|name| name.starts_with("aws-") || name.starts_with("sqlx"))
        .collect();
    assert!(heavy.is_empty(), "a Redis build pulls in {heavy:?}");
    // And each store brings its own: the DynamoDB build has the SDK, the PostgreSQL one sqlx.
    assert!(crates("dynamodb")
        .iter()
        .any(|name| name == "aws-sdk-dynamodb"));
    assert!(crates("postgres")
        .iter()
        .any(|name| name == "sqlx-postgres"));
}
