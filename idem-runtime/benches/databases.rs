//! SQLite and MySQL/MariaDB, each against hand-written statements on its own database: a
//! first execution against one `INSERT` of the result, a replay against one `SELECT`, and a
//! transfer in the caller's transaction against the bare transaction. Each is measured
//! interleaved with its baseline (`interleaved/mod.rs`), next to its floor: the least any
//! design that keeps idem's guarantees sends, written by hand (a first execution commits its
//! claim before the body and its result after it: an `INSERT` and an `UPDATE`; a claim in
//! a transaction writes a row before the body and updates it after). Target: the floor's
//! ratio + 10 %. Beside it, informative, the floor of a design whose replays take no write
//! lock, which reads the key before it claims it (a `SELECT`, then the floor's two), and in
//! a transaction the floor with a savepoint around the call (so that an `Err` undoes the
//! call alone) and, on MySQL, the read before the claim.
//!
//! `cargo bench -p idem-runtime --bench databases --features sqlite,mysql`
//! (MySQL at `IDEM_MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`; a database that
//! is unreachable is skipped with a line saying so.)

#[allow(dead_code)] // the Redis helpers are other benches'
mod common;
mod interleaved;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_runtime::{Error, MySqlStore, Operation, SqliteStore, Store};
use interleaved::{measure, on as side, Ratio};
use tokio::runtime::Runtime;

/// How long each pair of sides is measured, after calibration.
const BUDGET: Duration = Duration::from_secs(4);

/// A fresh number per call, so that every first execution has a key of its own.
fn fresh() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    common::run_start() * 1_000_000 + NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A row of the table: a path, its floor if it has one, and its target (none: the row
/// only shows where another row's time goes).
struct Row {
    path: String,
    ours: Ratio,
    floor: Option<Ratio>,
    target: Option<f64>,
}

impl Row {
    /// A path whose target is its floor's ratio + 10 %.
    fn floored(path: String, ours: Ratio, floor: Ratio) -> Self {
        let target = Some(floor.median * 1.1);
        Self {
            path,
            ours,
            floor: Some(floor),
            target,
        }
    }
}

/// The statements each database's hand-written side sends, in its dialect.
struct Dialect {
    create_raw: &'static str,
    insert: &'static str,
    update: &'static str,
    select: &'static str,
    create_ledger: &'static str,
    fill_ledger: &'static str,
    transfer: &'static str,
    create_claims: &'static str,
    insert_claim: &'static str,
    update_claim: &'static str,
    /// Whether a claim in a transaction reads the key before it writes (MySQL: so that a
    /// replay locks nothing); SQLite's takes the write lock first anyway.
    reads_in_transaction: bool,
}

/// Measures one database: `begin` opens the caller's transaction on `pool`.
macro_rules! database {
    ($rt:expr, $rows:expr, $name:literal, $store:expr, $pool:expr, $dialect:expr, |$p:ident| $begin:expr) => {{
        let (rt, store, pool, d): (&Runtime, _, _, &Dialect) = ($rt, $store, $pool, $dialect);
        let op = Operation::new(format!("bench.databases.{}", common::run_start()));
        let json = serde_json::to_vec(&common::receipt(1)).unwrap();
        rt.block_on(async {
            for statement in [
                d.create_raw,
                d.create_ledger,
                d.fill_ledger,
                d.create_claims,
            ] {
                sqlx::query(statement).execute(pool).await.unwrap();
            }
        });
        let replay = op.key(&u64::MAX).unwrap();
        let raw_key = replay.as_bytes().to_vec();
        rt.block_on(async {
            let recorded = op.run(store, &replay, None, async {
                Ok::<_, Error>(common::receipt(1))
            });
            assert!(!recorded.await.unwrap().is_replayed(), "a fresh key runs");
            sqlx::query(d.insert)
                .bind(&raw_key)
                .bind(&json)
                .execute(pool)
                .await
                .unwrap();
        });

        // The baseline of a first execution and of its claim: the result, inserted.
        let insert = || async {
            let key = op.key(&fresh()).unwrap();
            sqlx::query(d.insert)
                .bind(&key.as_bytes()[..])
                .bind(&json)
                .execute(pool)
                .await
                .unwrap()
        };
        let first = measure(
            &mut side(rt, || async {
                let key = op.key(&fresh()).unwrap();
                op.run(store, &key, None, async {
                    Ok::<_, Error>(common::receipt(1))
                })
                .await
                .unwrap()
            }),
            &mut side(rt, insert),
            BUDGET,
        );
        // Where a first execution's time goes: the store's claim alone.
        let claim = measure(
            &mut side(rt, || async {
                let key = op.key(&fresh()).unwrap();
                Store::claim(
                    store,
                    &idem_runtime::ClaimRequest::new(&key, Duration::from_secs(60)),
                )
                .await
                .unwrap()
            }),
            &mut side(rt, insert),
            BUDGET,
        );
        // The floor: the claim's row inserted, then its result written; `read_first`: a
        // design whose replays take no write lock reads the key before it claims it, as
        // ours does (informative: the target stays on the floor without the read).
        let floor = |read_first: bool| {
            let (op, json) = (&op, &json);
            move || async move {
                let key = op.key(&fresh()).unwrap();
                if read_first {
                    let found: Option<(Vec<u8>,)> = sqlx::query_as(d.select)
                        .bind(&key.as_bytes()[..])
                        .fetch_optional(pool)
                        .await
                        .unwrap();
                    assert!(found.is_none(), "a fresh key has no row");
                }
                sqlx::query(d.insert)
                    .bind(&key.as_bytes()[..])
                    .bind(None::<&[u8]>)
                    .execute(pool)
                    .await
                    .unwrap();
                sqlx::query(d.update)
                    .bind(json)
                    .bind(&key.as_bytes()[..])
                    .execute(pool)
                    .await
                    .unwrap()
            }
        };
        let first_floor = measure(&mut side(rt, floor(false)), &mut side(rt, insert), BUDGET);
        let read_floor = measure(&mut side(rt, floor(true)), &mut side(rt, insert), BUDGET);
        $rows.push(Row::floored(
            format!("first execution, {}", $name),
            first,
            first_floor,
        ));
        $rows.push(Row {
            path: format!("  floor with a read first, {}", $name),
            ours: read_floor,
            floor: None,
            target: None,
        });
        $rows.push(Row {
            path: format!("  of which the claim, {}", $name),
            ours: claim,
            floor: None,
            target: None,
        });

        let replayed = measure(
            &mut side(rt, || async {
                op.run(store, &replay, None, async {
                    Ok::<_, Error>(common::receipt(2))
                })
                .await
                .unwrap()
            }),
            &mut side(rt, || async {
                let (value,): (Vec<u8>,) = sqlx::query_as(d.select)
                    .bind(&raw_key)
                    .fetch_one(pool)
                    .await
                    .unwrap();
                serde_json::from_slice::<common::Receipt>(&value).unwrap()
            }),
            BUDGET,
        );
        $rows.push(Row {
            path: format!("replay, {}", $name),
            ours: replayed,
            floor: None,
            target: Some(1.1),
        });

        let bare = || async {
            let $p = pool;
            let mut tx = $begin;
            sqlx::query(d.transfer).execute(&mut *tx).await.unwrap();
            tx.commit().await.unwrap();
        };
        let in_transaction = measure(
            &mut side(rt, || async {
                let key = op.key(&fresh()).unwrap();
                let $p = pool;
                let mut tx = $begin;
                let moved = op
                    .run_in_transaction(store, &mut tx, &key, None, async |tx| {
                        sqlx::query(d.transfer)
                            .execute(&mut *tx)
                            .await
                            .map_err(Error::store)?;
                        Ok::<_, Error>(1_u64)
                    })
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                moved
            }),
            &mut side(rt, bare),
            BUDGET,
        );
        // The floor: a row written before the body and updated after it; `guarded`: also a
        // savepoint around the call (so that an `Err` undoes the call alone) and, where the
        // design reads first, the read (informative: the target stays on the floor).
        let transfer = |guarded: bool| {
            let (op, json) = (&op, &json);
            move || async move {
                let key = op.key(&fresh()).unwrap();
                let $p = pool;
                let mut tx = $begin;
                if guarded {
                    sqlx::raw_sql("SAVEPOINT bench")
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    if d.reads_in_transaction {
                        let found: Option<(Vec<u8>,)> = sqlx::query_as(d.select)
                            .bind(&key.as_bytes()[..])
                            .fetch_optional(&mut *tx)
                            .await
                            .unwrap();
                        assert!(found.is_none(), "a fresh key has no row");
                    }
                }
                sqlx::query(d.insert_claim)
                    .bind(&key.as_bytes()[..])
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                sqlx::query(d.transfer).execute(&mut *tx).await.unwrap();
                sqlx::query(d.update_claim)
                    .bind(json)
                    .bind(&key.as_bytes()[..])
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                if guarded {
                    sqlx::raw_sql("RELEASE SAVEPOINT bench")
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
            }
        };
        let transfer_floor = measure(&mut side(rt, transfer(false)), &mut side(rt, bare), BUDGET);
        let guarded_floor = measure(&mut side(rt, transfer(true)), &mut side(rt, bare), BUDGET);
        $rows.push(Row::floored(
            format!("transfer in a transaction, {}", $name),
            in_transaction,
            transfer_floor,
        ));
        $rows.push(Row {
            path: format!(
                "  floor with a savepoint{}, {}",
                if d.reads_in_transaction {
                    " and a read"
                } else {
                    ""
                },
                $name
            ),
            ours: guarded_floor,
            floor: None,
            target: None,
        });
    }};
}

const SQLITE: Dialect = Dialect {
    create_raw: "CREATE TABLE IF NOT EXISTS bench_raw (key BLOB PRIMARY KEY, value BLOB)",
    insert: "INSERT INTO bench_raw (key, value) VALUES (?1, ?2)",
    update: "UPDATE bench_raw SET value = ?1 WHERE key = ?2",
    select: "SELECT value FROM bench_raw WHERE key = ?1",
    create_ledger:
        "CREATE TABLE IF NOT EXISTS bench_ledger (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL)",
    fill_ledger: "INSERT OR IGNORE INTO bench_ledger VALUES (1, 0)",
    transfer: "UPDATE bench_ledger SET balance = balance + 1 WHERE id = 1",
    create_claims: "CREATE TABLE IF NOT EXISTS bench_claims (key BLOB PRIMARY KEY, value BLOB)",
    insert_claim: "INSERT INTO bench_claims (key) VALUES (?1)",
    update_claim: "UPDATE bench_claims SET value = ?1 WHERE key = ?2",
    reads_in_transaction: false,
};

const MYSQL: Dialect = Dialect {
    create_raw: "CREATE TABLE IF NOT EXISTS bench_raw (`key` VARBINARY(32) PRIMARY KEY, value LONGBLOB) ENGINE = InnoDB",
    insert: "INSERT INTO bench_raw (`key`, value) VALUES (?, ?)",
    update: "UPDATE bench_raw SET value = ? WHERE `key` = ?",
    select: "SELECT value FROM bench_raw WHERE `key` = ?",
    create_ledger: "CREATE TABLE IF NOT EXISTS bench_ledger (id INT PRIMARY KEY, balance BIGINT NOT NULL) ENGINE = InnoDB",
    fill_ledger: "INSERT IGNORE INTO bench_ledger VALUES (1, 0)",
    transfer: "UPDATE bench_ledger SET balance = balance + 1 WHERE id = 1",
    create_claims: "CREATE TABLE IF NOT EXISTS bench_claims (`key` VARBINARY(32) PRIMARY KEY, value LONGBLOB) ENGINE = InnoDB",
    insert_claim: "INSERT INTO bench_claims (`key`) VALUES (?)",
    update_claim: "UPDATE bench_claims SET value = ? WHERE `key` = ?",
    reads_in_transaction: true,
};

fn sqlite(rt: &Runtime, rows: &mut Vec<Row>) {
    let dir = std::env::temp_dir().join(format!("idem-bench-databases-{}", common::run_start()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = rt.block_on(async {
        let store = SqliteStore::open(dir.join("idem.db")).await.unwrap();
        store.migrate().await.unwrap();
        store
    });
    let pool = store.pool().clone();
    database!(rt, rows, "sqlite", &store, &pool, &SQLITE, |pool| pool
        .begin_with("BEGIN IMMEDIATE")
        .await
        .unwrap());
    let _ = std::fs::remove_dir_all(dir);
}

fn mysql(rt: &Runtime, rows: &mut Vec<Row>) {
    let url = std::env::var("IDEM_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let Ok(store) = rt.block_on(MySqlStore::connect(&url)) else {
        return println!("skipped: mysql at {url} is unreachable");
    };
    let store = store.with_table("idem_bench").unwrap();
    rt.block_on(store.migrate()).unwrap();
    let pool = store.pool().clone();
    database!(rt, rows, "mysql", &store, &pool, &MYSQL, |pool| pool
        .begin()
        .await
        .unwrap());
    rt.block_on(async {
        let _ = store.purge_expired().await;
        for table in ["bench_raw", "bench_ledger", "bench_claims"] {
            let _ = sqlx::query(&format!("DROP TABLE {table}"))
                .execute(&pool)
                .await;
        }
    });
}

fn main() {
    let rt = common::runtime();
    let mut rows = Vec::new();
    sqlite(&rt, &mut rows);
    mysql(&rt, &mut rows);
    println!(
        "\n{:<36} {:>10} {:>10} {:>6} {:>13} {:>6} {:>7} {:>6}",
        "path", "ours", "baseline", "ratio", "p10 – p90", "floor", "target", "pairs"
    );
    for row in &rows {
        let r = row.ours;
        let floor = row.floor.map_or("-".into(), |f| format!("{:.2}", f.median));
        let (target, verdict) = match row.target {
            Some(target) if r.median <= target => (format!("{target:.2}"), "ok"),
            Some(target) => (format!("{target:.2}"), "MISSED"),
            None => ("-".into(), ""),
        };
        println!(
            "{:<36} {:>10.1?} {:>10.1?} {:>6.2} {:>13} {floor:>6} {target:>7} {:>6} {verdict}",
            row.path,
            r.ours,
            r.baseline,
            r.median,
            format!("{:.2} – {:.2}", r.low, r.high),
            r.pairs,
        );
    }
}
