#!/usr/bin/env python3
"""The Rust version each feature set of idem-runtime needs, from the `rust-version` its
dependencies declare (`cargo metadata`); fails when one exceeds the workspace's.

    python3 scripts/msrv.py          # prints the table, exits 1 on a violation
"""
import json
import subprocess
import sys

FEATURE_SETS = {
    "default (macros, memory)": ["macros", "memory"],
    "redis": ["redis"],
    "dynamodb": ["dynamodb"],
    "postgres": ["postgres"],
    "http": ["http"],
    "testkit": ["testkit"],
    "metrics": ["metrics"],
    "lapin": ["lapin"],
    "nats": ["nats"],
    "tonic": ["tonic"],
    "rmcp": ["rmcp"],
    "all features": None,
}


# Features whose dependencies need a newer Rust than the crate declares, with that version:
# the README says so in its feature table. Every other feature set must build at the
# declared version.
OWN_MINIMUM = {
    "dynamodb": "1.94.1",  # aws-sdk-dynamodb's own rust-version
}


def version(text):
    parts = [int(part) for part in (text or "0").split(".")]
    return tuple((parts + [0, 0, 0])[:3])


def metadata():
    host = subprocess.run(["rustc", "-vV"], capture_output=True, text=True, check=True).stdout
    target = next(l.split(": ")[1] for l in host.splitlines() if l.startswith("host: "))
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--all-features", "--filter-platform", target],
        capture_output=True, text=True, check=True,
    ).stdout
    return json.loads(out)


def main():
    meta = metadata()
    packages = {p["id"]: p for p in meta["packages"]}
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    runtime = next(p for p in meta["packages"] if p["name"] == "idem-runtime")
    declared = version(runtime["rust_version"])

    def features_of(chosen):
        """The dependency names a feature set turns on, through the features it implies."""
        todo, seen, deps = list(chosen), set(), set()
        while todo:
            feature = todo.pop()
            if feature in seen:
                continue
            seen.add(feature)
            for item in runtime["features"].get(feature, []):
                if item.startswith("dep:"):
                    deps.add(item[4:])
                elif "/" not in item:
                    todo.append(item)
        return deps

    optional = {d["rename"] or d["name"] for d in runtime["dependencies"] if d["optional"]}

    def needed(chosen):
        allowed = None if chosen is None else features_of(chosen)
        start = []
        for dep in nodes[runtime["id"]]["deps"]:
            if not any(k["kind"] is None for k in dep["dep_kinds"]):
                continue
            if dep["name"].replace("_", "-") in optional or dep["name"] in optional:
                name = packages[dep["pkg"]]["name"]
                if allowed is not None and name not in allowed:
                    continue
            start.append(dep["pkg"])
        seen, stack = set(), start
        while stack:
            pkg = stack.pop()
            if pkg in seen:
                continue
            seen.add(pkg)
            stack += [d["pkg"] for d in nodes[pkg]["deps"]
                      if any(k["kind"] is None for k in d["dep_kinds"])]
        return max(((version(packages[p].get("rust_version")), packages[p]["name"]) for p in seen),
                   default=((0,), "-"))

    failed = False
    print(f"idem-runtime declares rust-version {runtime['rust_version']}")
    for label, chosen in FEATURE_SETS.items():
        needs, by = needed(chosen)
        owns = [version(v) for f, v in OWN_MINIMUM.items() if chosen is None or f in chosen]
        allowed = max([declared] + owns)
        ok = needs <= allowed
        failed |= not ok
        shown = ".".join(map(str, needs[:2] if needs[2] == 0 else needs))
        print(f"  {label:<26} needs {shown:<6} (highest: {by}){'' if ok else '  EXCEEDS the declared version'}"
              f"{'' if allowed == declared else '  (the feature' + chr(39) + 's own minimum: ' + '.'.join(map(str, allowed)) + ')'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
