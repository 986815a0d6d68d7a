//! What a record costs as work grows, each against the plainest way to keep the same data.
//!
//! `cargo bench -p idem-runtime --bench footprint --all-features` prints:
//! - `MemoryStore`: heap bytes per completed record at 10 k, 100 k and 1 M records (a
//!   counting allocator), against a raw moka cache of the same keys and values;
//! - Redis: `MEMORY USAGE` of a record against a plain string of the same value;
//! - PostgreSQL: table and index bytes per row, and the time `purge_expired()` takes for
//!   1 M expired rows, with the slowest claim made on other keys while it ran;
//! - SQLite: the file's bytes per completed record (pages in use, after a checkpoint);
//! - MySQL/MariaDB: InnoDB's data and index bytes per completed record.
//!
//! The server parts print `skipped` when their server is unreachable (`IDEM_REDIS_URL`,
//! `IDEM_POSTGRES_URL`, `IDEM_MYSQL_URL`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use self::common::receipt;
use bytes::Bytes;
use idem_runtime::{
    Error, MemoryStore, MySqlStore, Operation, PostgresStore, RedisStore, SqliteStore, Store,
};

mod common;

/// Counts the heap bytes in use.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

async fn memory() {
    println!("MemoryStore, heap bytes per completed record (a receipt of ~70 bytes of JSON):");
    println!(
        "{:>10} {:>14} {:>14} {:>6}",
        "records", "MemoryStore", "raw moka", "ratio"
    );
    for n in [10_000_u64, 100_000, 1_000_000] {
        let op = Operation::new("footprint.memory");
        let before = live();
        let store = MemoryStore::builder().capacity(n).build();
        for i in 0..n {
            let key = op.key(&i).unwrap();
            let body = async move { Ok::<_, Error>(receipt(i)) };
            let _ = op.run(&store, &key, None, body).await.unwrap();
        }
        let ours = (live() - before) as f64 / n as f64;
        drop(store);

        let before = live();
        let raw: moka::sync::Cache<[u8; 32], Bytes> = moka::sync::Cache::new(n);
        for i in 0..n {
            let key = *op.key(&i).unwrap().as_bytes();
            raw.insert(key, Bytes::from(serde_json::to_vec(&receipt(i)).unwrap()));
        }
        let baseline = (live() - before) as f64 / n as f64;
        drop(raw);
        println!(
            "{n:>10} {ours:>14.0} {baseline:>14.0} {:>6.2}",
            ours / baseline
        );
    }
}

async fn redis() {
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let Ok(store) = RedisStore::connect(&url).await else {
        println!("Redis: skipped ({url} unreachable)");
        return;
    };
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut redis = client.get_multiplexed_async_connection().await.unwrap();
    let op = Operation::new(format!("footprint.redis.{:?}", Instant::now()));
    let key = op.key(&1).unwrap();
    let _ = op
        .run(&store, &key, None, async { Ok::<_, Error>(receipt(1)) })
        .await
        .unwrap();
    let record = format!("idem:{{{}}}", key.to_hex());
    let ours: i64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&record)
        .query_async(&mut redis)
        .await
        .unwrap();
    let value = serde_json::to_vec(&receipt(1)).unwrap();
    let plain = format!("footprint:plain:{}", key.to_hex());
    let _: () = redis::cmd("SET")
        .arg(&plain)
        .arg(&value)
        .query_async(&mut redis)
        .await
        .unwrap();
    let baseline: i64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&plain)
        .query_async(&mut redis)
        .await
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg(&plain)
        .query_async(&mut redis)
        .await
        .unwrap();
    let _ = store.remove(&key).await;
    println!(
        "Redis, MEMORY USAGE of one completed record: {ours} bytes; a plain string of the same value: {baseline} bytes ({:.2})",
        ours as f64 / baseline as f64
    );
}

async fn postgres() {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let Ok(store) = PostgresStore::connect(&url).await else {
        println!("PostgreSQL: skipped ({url} unreachable)");
        return;
    };
    let table = "idem_records_footprint";
    let store = store.with_table(table).unwrap();
    store.migrate().await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let sql = |q: String| {
        let pool = pool.clone();
        async move { sqlx::query(&q).execute(&pool).await.unwrap() }
    };
    sql(format!("TRUNCATE {table}")).await;

    // Rows shaped as the store writes them: a 32-byte key and fingerprint, a receipt.
    let value = serde_json::to_string(&receipt(1)).unwrap();
    let insert = |n: u64, expiry: &str| {
        format!(
            "INSERT INTO {table} (key, token, completed, fingerprint, value, expires_at) \
             SELECT sha256(i::text::bytea), i, true, sha256(('f' || i)::bytea), \
                    convert_to('v{value}', 'UTF8'), now() + interval '{expiry}' \
             FROM generate_series(1, {n}) AS i"
        )
    };
    let rows = 100_000;
    sql(insert(rows, "1 day")).await;
    sql(format!("VACUUM ANALYZE {table}")).await;
    let bytes: i64 = sqlx::query_scalar(&format!("SELECT pg_total_relation_size('{table}')"))
        .fetch_one(&pool)
        .await
        .unwrap();
    println!(
        "PostgreSQL, table and index bytes per completed row ({rows} rows): {:.0}",
        bytes as f64 / rows as f64
    );

    // A purge of 1 M expired rows, with claims on other keys going on meanwhile.
    sql(format!("TRUNCATE {table}")).await;
    let expired = 1_000_000;
    sql(insert(expired, "-1 hour")).await;
    let purging = Arc::new(AtomicBool::new(true));
    let claims = {
        let (store, purging) = (store.clone(), purging.clone());
        tokio::spawn(async move {
            let op = Operation::new(format!("footprint.purge.{:?}", Instant::now()));
            let (mut slowest, mut count) = (Duration::ZERO, 0_u32);
            while purging.load(Ordering::Relaxed) {
                let key = op.key(&count).unwrap();
                let started = Instant::now();
                let _ = op
                    .run(&store, &key, None, async { Ok::<_, Error>(1_u8) })
                    .await
                    .unwrap();
                slowest = slowest.max(started.elapsed());
                count += 1;
            }
            (slowest, count)
        })
    };
    let started = Instant::now();
    let purged = store.purge_expired().await.unwrap();
    let took = started.elapsed();
    purging.store(false, Ordering::Relaxed);
    let (slowest, count) = claims.await.unwrap();
    println!(
        "PostgreSQL, purge_expired() of {expired} expired rows: {purged} deleted in {took:.2?}; \
         {count} calls on other keys meanwhile, the slowest {slowest:.2?}"
    );
    sql(format!("DROP TABLE {table}")).await;
}

/// Completes `records` calls of a fresh namespace on `store`, 32 at a time: rows exactly as
/// the store writes them.
async fn fill<S: Store + Clone + 'static>(store: &S, records: u32) {
    let op = Operation::new(format!("footprint.{:?}", Instant::now()));
    let mut calls = tokio::task::JoinSet::new();
    for n in 0..records {
        if calls.len() == 32 {
            calls.join_next().await.unwrap().unwrap();
        }
        let (op, store) = (op.clone(), store.clone());
        calls.spawn(async move {
            let key = op.key(&n).unwrap();
            let ran = op.run(&store, &key, None, async move {
                Ok::<_, Error>(receipt(n.into()))
            });
            assert!(!ran.await.unwrap().is_replayed(), "a fresh key runs");
        });
    }
    while let Some(call) = calls.join_next().await {
        call.unwrap();
    }
}

const SQL_RECORDS: u32 = 20_000;

async fn sqlite() {
    let dir = std::env::temp_dir().join(format!("idem-footprint-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = SqliteStore::open(dir.join("idem.db")).await.unwrap();
    store.migrate().await.unwrap();
    let pages = |store: SqliteStore| async move {
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(store.pool())
            .await
            .unwrap();
        let count: i64 = sqlx::query_scalar("PRAGMA page_count")
            .fetch_one(store.pool())
            .await
            .unwrap();
        let free: i64 = sqlx::query_scalar("PRAGMA freelist_count")
            .fetch_one(store.pool())
            .await
            .unwrap();
        let size: i64 = sqlx::query_scalar("PRAGMA page_size")
            .fetch_one(store.pool())
            .await
            .unwrap();
        (count - free) * size
    };
    let empty = pages(store.clone()).await;
    fill(&store, SQL_RECORDS).await;
    let full = pages(store.clone()).await;
    println!(
        "SQLite, file bytes per completed record ({SQL_RECORDS} records): {:.0}",
        (full - empty) as f64 / f64::from(SQL_RECORDS)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

async fn mysql() {
    let url = std::env::var("IDEM_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let Ok(store) = MySqlStore::connect(&url).await else {
        println!("MySQL: skipped ({url} unreachable)");
        return;
    };
    let table = "idem_records_footprint";
    let store = store.with_table(table).unwrap();
    store.migrate().await.unwrap();
    let sql = |q: String| {
        let store = store.clone();
        async move { sqlx::query(&q).execute(store.pool()).await.unwrap() }
    };
    sql(format!("TRUNCATE `{table}`")).await;
    fill(&store, SQL_RECORDS).await;
    sql(format!("ANALYZE TABLE `{table}`")).await;
    let (data, index): (i64, i64) = sqlx::query_as(
        "SELECT CAST(data_length AS SIGNED), CAST(index_length AS SIGNED) \
         FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?",
    )
    .bind(table)
    .fetch_one(store.pool())
    .await
    .unwrap();
    println!(
        "MySQL, InnoDB data and index bytes per completed record ({SQL_RECORDS} records): {:.0} ({:.0} data, {:.0} index)",
        (data + index) as f64 / f64::from(SQL_RECORDS),
        data as f64 / f64::from(SQL_RECORDS),
        index as f64 / f64::from(SQL_RECORDS)
    );
    sql(format!("DROP TABLE `{table}`")).await;
}

fn main() {
    let rt = common::runtime();
    rt.block_on(async {
        memory().await;
        redis().await;
        postgres().await;
        sqlite().await;
        mysql().await;
    });
}
