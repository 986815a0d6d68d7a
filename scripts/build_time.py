#!/usr/bin/env python3
"""What `#[idempotent]` costs an incremental debug build.

Generates two copies of one application crate: twenty async handlers with `#[idempotent]`,
and the same twenty without the attribute. Both build once; then, round after round and
alternating which goes first, one handler's body is edited and `cargo build` timed, for each
copy. Prints every round, the medians and their ratio (with / without).

    python3 scripts/build_time.py            # 7 rounds
    python3 scripts/build_time.py --rounds 3 --check 1.3   # exits 1 above a ratio of 1.3
    python3 scripts/build_time.py --rounds 0 --ir           # lines of LLVM IR of each copy

The crates live in `target/build-time/` with their own target directory (shared by both
copies, so that the dependencies build once), and build against the workspace's
`Cargo.lock`.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "target", "build-time")
HANDLERS = int(os.environ.get("IDEM_BUILD_TIME_HANDLERS", "20"))
EDITED = 7  # the handler whose body each round edits

MANIFEST = """[package]
name = "{name}"
version = "0.0.0"
edition = "2021"
publish = false

[workspace]

[dependencies]
idem-runtime = {{ path = "{runtime}" }}
serde = {{ version = "1", features = ["derive"] }}
tokio = {{ version = "1", features = ["rt", "macros"] }}

[profile.dev]
debug = "line-tables-only"

[profile.dev.package."*"]
debug = false
"""

PRELUDE = """use serde::{Deserialize, Serialize};

#[allow(unused_imports)]
use idem_runtime::idempotent;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Order {
    pub id: u64,
    pub customer: String,
    pub cents: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Receipt {
    pub id: u64,
    pub cents: u64,
    pub note: String,
}

#[derive(Debug)]
pub enum AppError {
    Declined(u64),
    Idem(idem_runtime::Error),
}

impl From<idem_runtime::Error> for AppError {
    fn from(error: idem_runtime::Error) -> Self {
        Self::Idem(error)
    }
}
"""

# Four shapes of `Ok` value, so that the handlers are not twenty copies of one type.
RETURNS = [
    ("Receipt", "Receipt {{ id: order.id, cents, note: format!(\"handler {i} for {{}}\", order.customer) }}"),
    ("u64", "cents + {i}"),
    ("String", "format!(\"{{}}:{{}}:{i}\", order.customer, cents)"),
    ("Vec<u64>", "vec![order.id, cents, {i}]"),
]


def handler(i, annotated, salt):
    ty, value = RETURNS[i % len(RETURNS)]
    attr = (
        f'#[idempotent(key = (order.id, &order.customer), ttl = "1h", namespace = "app.h{i:02}")]\n'
        if annotated
        else ""
    )
    edit = salt if i == EDITED else 0
    return f"""
{attr}pub async fn handler_{i:02}(order: &Order) -> Result<{ty}, AppError> {{
    let salt: u64 = {edit};
    let cents = order.cents.wrapping_mul({i + 1}).wrapping_add(salt);
    if cents % 1_000_003 == {i} {{
        return Err(AppError::Declined(cents));
    }}
    Ok({value.format(i=i)})
}}
"""


def source(annotated, salt):
    calls = "\n".join(
        f"    println!(\"{{:?}}\", handler_{i:02}(&order).await.map_err(|e| format!(\"{{e:?}}\")));"
        for i in range(HANDLERS)
    )
    handlers = "".join(handler(i, annotated, salt) for i in range(HANDLERS))
    return f"""{PRELUDE}{handlers}
#[tokio::main(flavor = "current_thread")]
async fn main() {{
    let order = Order {{ id: 17, customer: "ada".into(), cents: 4_200 }};
{calls}
}}
"""


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def crate(name):
    return os.path.join(HERE, name)


def build(name):
    env = dict(os.environ, CARGO_TARGET_DIR=os.path.join(HERE, "target"), CARGO_TERM_COLOR="never")
    started = time.perf_counter()
    subprocess.run(
        ["cargo", "build", "--quiet"], cwd=crate(name), env=env, check=True
    )
    return time.perf_counter() - started


def ir_lines(name):
    """Lines inside function bodies of the copy's LLVM IR: the code generation it asks for."""
    env = dict(os.environ, CARGO_TARGET_DIR=os.path.join(HERE, "target"), CARGO_TERM_COLOR="never")
    path = os.path.join(HERE, f"{name}.ll")
    subprocess.run(
        ["cargo", "rustc", "--quiet", "--", f"--emit=llvm-ir={path}"],
        cwd=crate(name), env=env, check=True,
    )
    lines, inside = 0, False
    with open(path) as f:
        for line in f:
            if line.startswith("define "):
                inside = True
            elif line.startswith("}"):
                inside = False
            elif inside:
                lines += 1
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--check", type=float, help="exit 1 when the median ratio exceeds this")
    parser.add_argument("--ir", action="store_true", help="also count each copy's LLVM IR lines")
    args = parser.parse_args()

    variants = {"with": True, "without": False}
    for name, annotated in variants.items():
        write(
            os.path.join(crate(name), "Cargo.toml"),
            MANIFEST.format(name=f"idem-build-time-{name}", runtime=os.path.join(ROOT, "idem-runtime")),
        )
        shutil.copy(os.path.join(ROOT, "Cargo.lock"), os.path.join(crate(name), "Cargo.lock"))
        write(os.path.join(crate(name), "src", "main.rs"), source(annotated, 1))
        build(name)  # dependencies and the first full build: not measured

    if args.ir:
        for name in variants:
            print(f"{name:>8}: {ir_lines(name):,} lines of LLVM IR in function bodies")
    if args.rounds == 0:
        return 0

    times = {name: [] for name in variants}
    print(f"{'round':>5}  {'with':>8}  {'without':>8}  ratio")
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            write(os.path.join(crate(name), "src", "main.rs"), source(variants[name], round_ + 2))
            times[name].append(build(name))
        w, wo = times["with"][-1], times["without"][-1]
        print(f"{round_ + 1:>5}  {w:>7.2f}s  {wo:>7.2f}s  {w / wo:.2f}")
    w, wo = statistics.median(times["with"]), statistics.median(times["without"])
    ratio = w / wo
    print(f"median  {w:>7.2f}s  {wo:>7.2f}s  {ratio:.2f}  ({HANDLERS} handlers, one edited per round)")
    if args.check is not None and ratio > args.check:
        print(f"the ratio {ratio:.2f} exceeds {args.check}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
