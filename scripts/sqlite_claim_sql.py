#!/usr/bin/env python3
"""What the SQLite store's claim costs in SQL alone, without the store around it.

The store's lone claim is one statement (`take_in_time` in `idem-runtime/src/store/sqlite/statements.rs`,
written out below as the store writes it for its default table). This runs it, committed by
itself, on files in WAL mode with `synchronous = FULL` as `SqliteStore::open` sets them,
interleaved with the baseline of the `databases` bench (an `INSERT` into a plain table) and
with the same statement on a table without the token counter, and prints each one's mean
and its ratio to the `INSERT`. Python's `sqlite3` sends a statement without the thread
hop of `sqlx`: what the `databases` bench measures beyond these ratios is the store's own.

    python3 scripts/sqlite_claim_sql.py               # 3000 rounds
    python3 scripts/sqlite_claim_sql.py --rounds 500

The files live in a temporary directory, removed at the end.
"""
import argparse
import os
import sqlite3
import tempfile
import time

# The store's clock, in Unix milliseconds (`NOW` in sqlite.rs).
NOW = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"

# The table, its index, the token counter and its triggers, as `SqliteStore::migrate` creates
# them; `counter = False` leaves the counter and triggers out (the token is then a constant).
def schema(counter):
    statements = [
        "CREATE TABLE idem_records (key BLOB PRIMARY KEY NOT NULL, token INTEGER NOT NULL, "
        "completed INTEGER NOT NULL, fingerprint BLOB, value BLOB, "
        "expires_at INTEGER NOT NULL) WITHOUT ROWID",
        "CREATE INDEX idem_records_expires_at ON idem_records (expires_at)",
    ]
    if counter:
        statements += [
            "CREATE TABLE idem_records_token (id INTEGER PRIMARY KEY CHECK (id = 1), "
            "last INTEGER NOT NULL)",
            "INSERT INTO idem_records_token (id, last) VALUES (1, 0)",
            "CREATE TRIGGER idem_records_token_inserted AFTER INSERT ON idem_records BEGIN "
            "UPDATE idem_records_token SET last = NEW.token WHERE id = 1 AND last < NEW.token; END",
            "CREATE TRIGGER idem_records_token_updated AFTER UPDATE OF token ON idem_records BEGIN "
            "UPDATE idem_records_token SET last = NEW.token WHERE id = 1 AND last < NEW.token; END",
        ]
    return statements


# The lone claim (`take_in_time`): ?1 key, ?2 fingerprint, ?3 lease (ms), ?4 nonce, ?5 the
# moment after which it writes nothing.
def take(counter):
    token = "(SELECT last + 1 FROM idem_records_token WHERE id = 1)" if counter else "1"
    t = "idem_records"
    return (
        f"INSERT INTO {t} (key, token, completed, fingerprint, value, expires_at) "
        f"SELECT ?1, {token}, 0, ?2, ?4, {NOW} + ?3 WHERE {NOW} < ?5 "
        f"ON CONFLICT (key) DO UPDATE SET token = excluded.token, completed = 0, "
        f"fingerprint = excluded.fingerprint, value = excluded.value, expires_at = excluded.expires_at "
        f"WHERE {t}.expires_at <= {NOW} "
        f"OR (NOT {t}.completed AND substr({t}.value, 1, 8) = excluded.value) "
        f"RETURNING token"
    )


def open_file(directory, name, statements):
    connection = sqlite3.connect(os.path.join(directory, name), isolation_level=None)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = FULL")
    for statement in statements:
        connection.execute(statement)
    return connection


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3000)
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory(prefix="idem-claim-sql-") as directory:
        insert = open_file(
            directory, "insert.db", ["CREATE TABLE bench_raw (key BLOB PRIMARY KEY, value BLOB)"]
        )
        sides = {
            "INSERT (the databases bench's baseline)": (
                insert,
                "INSERT INTO bench_raw (key, value) VALUES (?1, ?2)",
                lambda key: (key, b"x" * 8),
            ),
            "the store's claim": (
                open_file(directory, "claim.db", schema(True)),
                take(True),
                None,
            ),
            "the claim without the token counter": (
                open_file(directory, "no-counter.db", schema(False)),
                take(False),
                None,
            ),
        }
        spent = {name: 0.0 for name in sides}
        for _ in range(rounds):
            for name, (connection, statement, arguments) in sides.items():
                key = os.urandom(32)
                until = int(time.time() * 1000) + 60_000
                values = arguments(key) if arguments else (key, None, 30_000, os.urandom(8), until)
                started = time.perf_counter()
                connection.execute(statement, values).fetchall()
                spent[name] += time.perf_counter() - started
        baseline = spent["INSERT (the databases bench's baseline)"]
        for name, total in spent.items():
            print(f"{name:45} {total / rounds * 1e6:8.1f} µs  {total / baseline:5.2f}")


if __name__ == "__main__":
    main()
