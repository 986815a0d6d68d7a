#!/usr/bin/env python3
"""Checks that every feature a user turns on builds: each feature of idem-runtime alone,
each store with `admin`, `testkit` and `metrics` beside it, and idem-cli with each store
alone. Checked, not built (no code generation), the crate's warnings denied, in the
workspace's target directory, so that the dependencies' metadata is shared with the other
steps.

    python3 scripts/features.py          # exits 1 at the first combination that fails
"""
import json
import subprocess
import sys
import time

STORES = ["memory", "redis", "postgres", "mysql", "sqlite", "dynamodb"]


def runtime_features():
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        capture_output=True, text=True, check=True,
    ).stdout
    runtime = next(p for p in json.loads(out)["packages"] if p["name"] == "idem-runtime")
    return sorted(name for name in runtime["features"] if name != "default")


def check(package, features):
    # `cargo rustc` hands `-D warnings` to this crate alone: its dependencies keep the
    # flags (and so the artifacts) of every other step.
    target = ["--lib"] if package == "idem-runtime" else ["--bin", "idem"]
    command = ["cargo", "rustc", "--quiet", "--profile", "check", "-p", package, *target,
               "--no-default-features"]
    if features:
        command += ["--features", ",".join(features)]
    command += ["--", "-D", "warnings"]
    started = time.monotonic()
    done = subprocess.run(command)
    label = f"{package} --features {','.join(features) or '(none)'}"
    print(f"{time.monotonic() - started:6.1f} s  {label}", flush=True)
    if done.returncode != 0:
        print(f"FAILED: {label}", file=sys.stderr)
        sys.exit(1)


def main():
    combinations = [("idem-runtime", [])]
    combinations += [("idem-runtime", [feature]) for feature in runtime_features()]
    for store in STORES:
        combinations += [("idem-runtime", [store, extra]) for extra in ("admin", "testkit", "metrics")]
    combinations += [("idem-cli", [store]) for store in STORES if store != "memory"]
    for package, features in combinations:
        check(package, features)
    print(f"{len(combinations)} combinations build")


if __name__ == "__main__":
    main()
