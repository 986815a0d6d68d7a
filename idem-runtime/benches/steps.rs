//! What a step (`idem_runtime::step`) costs, interleaved with its baseline
//! (`interleaved/mod.rs`):
//!
//! - a replayed step against a memory replay of a hand-keyed nested call (what a body had to
//!   write before steps: an `Operation::run` of its own per effect, its key derived from the
//!   call's), both inside a running body, in memory. Target ≤ 1.2.
//! - a three-step body's first run against the same body without steps, on PostgreSQL:
//!   each step is one committed `INSERT` (an effect of the size of a write to another
//!   system). Target ≤ 1.3.
//! - a step that runs (an effect that costs nothing, so that what is measured is its
//!   record) against one raw write of the same store (Redis `SET`, a committed `INSERT` on
//!   PostgreSQL, SQLite and MySQL), both inside a running body. Target ≤ 1.2.
//!
//! `cargo bench -p idem-runtime --bench steps --features memory,redis,postgres,sqlite,mysql`
//! (Redis, PostgreSQL and MySQL at `IDEM_REDIS_URL`, `IDEM_POSTGRES_URL`, `IDEM_MYSQL_URL`, or
//! their defaults; a server that is unreachable is skipped with a line saying so.)

#[allow(dead_code)] // the Redis helpers are other benches'
mod common;
mod interleaved;

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idem_runtime::{
    step, Error, MemoryStore, MySqlStore, Operation, PostgresStore, RedisStore, SqliteStore, Store,
};
use interleaved::{measure, on as side, Ratio};
use tokio::runtime::Runtime;

/// How long each pair of sides is measured, after calibration.
const BUDGET: Duration = Duration::from_secs(4);

/// How many steps (and nested calls) are recorded before the replays are measured: more
/// than any batch replays.
const RECORDED: u64 = 1 << 16;

/// Runs `body` as the body of an attempt of `op`'s call `call` in `store`, releases the key
/// (the body fails), and returns how long `body` took: one batch of a side measured inside a
/// running body.
fn in_a_body<S, F>(rt: &Runtime, store: &S, op: &Operation, call: u64, body: F) -> Duration
where
    S: Store + Clone,
    F: std::future::Future<Output = Result<(), Error>>,
{
    let took = Mutex::new(Duration::ZERO);
    let key = op.key(&call).unwrap();
    let outcome = rt.block_on(op.run(store, &key, None, async {
        let started = Instant::now();
        body.await
            .map_err(|e| panic!("the measured body failed: {e}"))?;
        *took.lock().unwrap() = started.elapsed();
        Err::<(), _>(Error::store(
            "measured: the key is released for the next batch",
        ))
    }));
    assert!(outcome.is_err(), "every batch runs the body");
    took.into_inner().unwrap()
}

fn replayed_step(rt: &Runtime) -> Ratio {
    // Room for every record: past the default capacity, a replay would find it evicted.
    let store = MemoryStore::builder().capacity(4 * RECORDED).build();
    let outer = Operation::new("bench.steps.call");
    let nested = Operation::new("bench.steps.nested");
    // Record the nested calls the baseline replays.
    rt.block_on(async {
        for n in 0..RECORDED {
            let key = nested.key(&(1_u64, "charge", n)).unwrap();
            let run = nested.run(&store, &key, None, async {
                Ok::<_, Error>(common::receipt(1))
            });
            assert!(!run.await.unwrap().is_replayed());
        }
    });
    measure(
        &mut |iters: u64| {
            assert!(iters <= RECORDED, "a batch replays only recorded steps");
            // A call of its own with `iters` recorded steps (not timed), then its replay:
            // what is timed reads them in one step and replays each.
            let call = fresh();
            in_a_body(rt, &store, &outer, call, async {
                for _ in 0..iters {
                    step("charge", async { Ok::<_, Error>(common::receipt(1)) }).await?;
                }
                Ok(())
            });
            in_a_body(rt, &store, &outer, call, async {
                for _ in 0..iters {
                    let replayed = step("charge", async {
                        unreachable!("a recorded step does not run")
                    });
                    black_box::<common::Receipt>(replayed.await?);
                }
                Ok(())
            })
        },
        &mut |iters: u64| {
            assert!(iters <= RECORDED, "a batch replays only recorded calls");
            in_a_body(rt, &store, &outer, 2, async {
                for n in 0..iters {
                    let key = nested.key(&(1_u64, "charge", n))?;
                    let replayed = nested.run(&store, &key, None, async {
                        unreachable!("a recorded call does not run")
                    });
                    black_box::<common::Receipt>(replayed.await?.into_inner());
                }
                Ok(())
            })
        },
        BUDGET,
    )
}

/// A fresh number per call, so that every first execution has a key of its own.
fn fresh() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    common::run_start() * 1_000_000 + NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The three-step body against the same body without steps, and the floor against the same.
fn three_steps_on_postgres(rt: &Runtime) -> Option<(Ratio, Ratio)> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let Ok(store) = rt.block_on(PostgresStore::connect(&url)) else {
        println!("skipped: postgres at {url} is unreachable");
        return None;
    };
    rt.block_on(store.migrate()).unwrap();
    let pool = store.pool().clone();
    let table = format!("bench_step_effects_{}", std::process::id());
    rt.block_on(
        sqlx::query(&format!(
            "CREATE TABLE {table} (n bigint NOT NULL, what text NOT NULL)"
        ))
        .execute(&pool),
    )
    .unwrap();
    let insert = format!("INSERT INTO {table} (n, what) VALUES ($1, $2)");
    let effect = |n: u64, what: &'static str| {
        let (pool, insert) = (&pool, &insert);
        async move {
            sqlx::query(insert)
                .bind(n as i64)
                .bind(what)
                .execute(pool)
                .await
                .map_err(Error::store)?;
            Ok::<_, Error>(n)
        }
    };
    let op = Operation::new(format!("bench.steps.first.{}", common::run_start()));
    let without_steps = || async {
        let n = fresh();
        let key = op.key(&n).unwrap();
        op.run(&store, &key, None, async {
            let a = effect(n, "reserve").await?;
            let b = effect(n, "charge").await?;
            let c = effect(n, "order").await?;
            Ok::<_, Error>(a + b + c)
        })
        .await
        .unwrap()
    };
    // The floor: the least a step that survives a crash costs, written by hand: one
    // committed write of its result after its effect, and nothing else (no read of an
    // earlier record, no fence).
    let floor = measure(
        &mut side(rt, || async {
            let n = fresh();
            let key = op.key(&n).unwrap();
            op.run(&store, &key, None, async {
                let a = effect(n, "reserve").await?;
                effect(a, "reserve recorded").await?;
                let b = effect(n, "charge").await?;
                effect(b, "charge recorded").await?;
                let c = effect(n, "order").await?;
                effect(c, "order recorded").await?;
                Ok::<_, Error>(a + b + c)
            })
            .await
            .unwrap()
        }),
        &mut side(rt, without_steps),
        BUDGET,
    );
    let ratio = measure(
        &mut side(rt, || async {
            let n = fresh();
            let key = op.key(&n).unwrap();
            op.run(&store, &key, None, async {
                let a = step("reserve", effect(n, "reserve")).await?;
                let b = step("charge", effect(n, "charge")).await?;
                let c = step("order", effect(n, "order")).await?;
                Ok::<_, Error>(a + b + c)
            })
            .await
            .unwrap()
        }),
        &mut side(rt, without_steps),
        BUDGET,
    );
    rt.block_on(async {
        sqlx::query(&format!("DROP TABLE {table}"))
            .execute(&pool)
            .await
            .unwrap();
        store.purge_expired().await.ok();
    });
    Some((ratio, floor))
}

/// Steps that run, a batch in one body, against as many raw writes of `write`, in a body of
/// the same store: what a step's record costs over the write it is.
fn step_vs_write<S, W, Fut>(rt: &Runtime, store: &S, write: W) -> Ratio
where
    S: Store + Clone,
    W: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = Result<(), Error>>,
{
    let op = Operation::new(format!("bench.steps.write.{}", common::run_start()));
    measure(
        &mut |iters: u64| {
            in_a_body(rt, store, &op, fresh(), async {
                for i in 0..iters {
                    black_box(step("write", async move { Ok::<_, Error>(i) }).await?);
                }
                Ok(())
            })
        },
        &mut |iters: u64| {
            in_a_body(rt, store, &op, fresh(), async {
                for i in 0..iters {
                    write(i).await?;
                }
                Ok(())
            })
        },
        BUDGET,
    )
}

/// The table of one process's raw writes, `(n, v)`.
fn bench_table() -> String {
    format!("bench_step_writes_{}", std::process::id())
}

fn redis_row(rt: &Runtime) -> Option<Ratio> {
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let (Ok(store), Ok(client)) = (
        rt.block_on(RedisStore::connect(&url)),
        redis::Client::open(url.as_str()),
    ) else {
        println!("skipped: redis at {url} is unreachable");
        return None;
    };
    let con = rt
        .block_on(redis::aio::ConnectionManager::new(client))
        .ok()?;
    let run = common::run_start();
    Some(step_vs_write(rt, &store, |i| {
        let mut con = con.clone();
        async move {
            let key = format!("bench:step-write:{run}:{i}");
            redis::cmd("SET")
                .arg(key)
                .arg(format!("v{i}"))
                .arg("PX")
                .arg(60_000)
                .query_async::<()>(&mut con)
                .await
                .map_err(Error::store)
        }
    }))
}

/// A step run against a committed `INSERT` into a table of `pool`'s database, made with the
/// column types `columns` and filled with `insert` (the table name written in), dropped
/// after.
fn insert_row<S, DB>(
    rt: &Runtime,
    store: &S,
    pool: &sqlx::Pool<DB>,
    columns: &str,
    insert: &str,
) -> Ratio
where
    S: Store + Clone,
    DB: sqlx::Database,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let table = bench_table();
    let create = format!("CREATE TABLE {table} {columns}");
    rt.block_on(sqlx::query(&create).execute(pool)).unwrap();
    let insert = insert.replace("{table}", &table);
    let ratio = step_vs_write(rt, store, |i| {
        let insert = &insert;
        async move {
            let value = format!("v{i}");
            sqlx::query(insert)
                .bind(i as i64)
                .bind(value.as_bytes())
                .execute(pool)
                .await
                .map(drop)
                .map_err(Error::store)
        }
    });
    let drop_table = format!("DROP TABLE {table}");
    rt.block_on(sqlx::query(&drop_table).execute(pool)).unwrap();
    ratio
}

fn postgres_row(rt: &Runtime) -> Option<Ratio> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let Ok(store) = rt.block_on(PostgresStore::connect(&url)) else {
        println!("skipped: postgres at {url} is unreachable");
        return None;
    };
    rt.block_on(store.migrate()).unwrap();
    let ratio = insert_row(
        rt,
        &store,
        store.pool(),
        "(n bigint NOT NULL, v bytea NOT NULL)",
        "INSERT INTO {table} (n, v) VALUES ($1, $2)",
    );
    rt.block_on(store.purge_expired()).ok();
    Some(ratio)
}

fn sqlite_row(rt: &Runtime) -> Ratio {
    let dir = std::env::temp_dir().join(format!("idem-bench-steps-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = rt
        .block_on(SqliteStore::open(dir.join("steps.db")))
        .unwrap();
    rt.block_on(store.migrate()).unwrap();
    let ratio = insert_row(
        rt,
        &store,
        store.pool(),
        "(n INTEGER NOT NULL, v BLOB NOT NULL)",
        "INSERT INTO {table} (n, v) VALUES (?1, ?2)",
    );
    drop(store);
    std::fs::remove_dir_all(&dir).ok();
    ratio
}

fn mysql_row(rt: &Runtime) -> Option<Ratio> {
    let url = std::env::var("IDEM_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let Ok(store) = rt.block_on(MySqlStore::connect(&url)) else {
        println!("skipped: mysql at {url} is unreachable");
        return None;
    };
    rt.block_on(store.migrate()).unwrap();
    let ratio = insert_row(
        rt,
        &store,
        store.pool(),
        "(n BIGINT NOT NULL, v VARBINARY(64) NOT NULL) ENGINE = InnoDB",
        "INSERT INTO {table} (n, v) VALUES (?, ?)",
    );
    rt.block_on(store.purge_expired()).ok();
    Some(ratio)
}

fn main() {
    let rt = common::runtime();
    let mut rows = vec![(
        "replayed step vs a nested call's replay, memory",
        replayed_step(&rt),
        Some(1.2),
    )];
    if let Some((ratio, floor)) = three_steps_on_postgres(&rt) {
        rows.push((
            "three-step body vs without steps, postgres",
            ratio,
            Some(1.3),
        ));
        rows.push((
            "  its floor: a record written per step by hand",
            floor,
            None,
        ));
    }
    let step_rows = [
        ("a step run vs a raw SET, redis", redis_row(&rt)),
        ("a step run vs a raw INSERT, postgres", postgres_row(&rt)),
        ("a step run vs a raw INSERT, sqlite", Some(sqlite_row(&rt))),
        ("a step run vs a raw INSERT, mysql", mysql_row(&rt)),
    ];
    for (path, ratio) in step_rows {
        if let Some(ratio) = ratio {
            rows.push((path, ratio, Some(1.2)));
        }
    }
    println!(
        "\n{:<48} {:>10} {:>10} {:>6} {:>13} {:>7} {:>6}",
        "path", "ours", "baseline", "ratio", "p10 – p90", "target", "pairs"
    );
    for (path, r, target) in rows {
        let (target, verdict) = match target {
            Some(target) if r.median <= target => (format!("{target:.2}"), "ok"),
            Some(target) => (format!("{target:.2}"), "MISSED"),
            None => ("-".into(), ""),
        };
        println!(
            "{path:<48} {:>10.1?} {:>10.1?} {:>6.2} {:>13} {target:>7} {:>6} {verdict}",
            r.ours,
            r.baseline,
            r.median,
            format!("{:.2} – {:.2}", r.low, r.high),
            r.pairs,
        );
    }
}
