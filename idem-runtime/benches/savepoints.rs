//! Many calls in one transaction: the cost of a call must not grow with the calls before it
//! in the same transaction. 10 000 transactional calls whose bodies update one shared row
//! (a ledger's balance), or insert a journal line, against the same 10 000 bodies without idem (bare, and each in a
//! savepoint of its own, released after it, as a hand-written version that can roll a failed
//! call back needs), each in a transaction of its own run, in alternation; the cost of the
//! last 100 calls is printed against the first 100's.
//!
//! `cargo bench -p idem-runtime --bench savepoints --features postgres`

#[allow(dead_code)] // the receipt is other benches'
mod common;

use std::time::{Duration, Instant};

use idem_runtime::{Error, Operation, PostgresStore};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection};

const CALLS: usize = 10_000;
const BLOCK: usize = 100;

fn main() {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    common::runtime().block_on(async {
        let Ok(pool) = PgPoolOptions::new().max_connections(2).connect(&url).await else {
            println!("skipped: postgresql at {url} is unavailable");
            return;
        };
        let store = PostgresStore::from_pool(pool.clone());
        store.migrate().await.expect("migrate");
        let table = format!("savepoints_{}", common::run_start());
        sqlx::query(&format!("CREATE TABLE {table}_journal (id bigserial PRIMARY KEY, n int NOT NULL)"))
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query(&format!("CREATE TABLE {table} (id int PRIMARY KEY, balance bigint NOT NULL)"))
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query(&format!("INSERT INTO {table} VALUES (1, 0)"))
            .execute(&pool)
            .await
            .unwrap();
        let bodies = [
            ("a shared row updated", format!("UPDATE {table} SET balance = balance + 1 WHERE id = 1")),
            ("a journal line inserted", format!("INSERT INTO {table}_journal (n) VALUES (1)")),
        ];
        let op = Operation::new(format!("bench.savepoints.{}", common::run_start()));
        let mut conn = PgConnection::connect(&url).await.unwrap();

        // Alternating: the baseline's transaction, then ours, so that load lands on both.
        let mut rounds = Vec::new();
        for round in 0..4 {
            let (body, update) = &bodies[round % 2];
            let mut tx = conn.begin().await.unwrap();
            let mut bare = Vec::with_capacity(CALLS);
            for _ in 0..CALLS {
                let started = Instant::now();
                sqlx::query(update).execute(&mut *tx).await.unwrap();
                bare.push(started.elapsed());
            }
            tx.rollback().await.unwrap();

            // What a hand-written version needs to roll a failed call back: each body in a
            // savepoint of its own, released after it.
            let mut tx = conn.begin().await.unwrap();
            let mut savepointed = Vec::with_capacity(CALLS);
            let wrapped = format!("SAVEPOINT s; {update}; RELEASE SAVEPOINT s");
            for _ in 0..CALLS {
                let started = Instant::now();
                sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&wrapped)).await.unwrap();
                savepointed.push(started.elapsed());
            }
            tx.rollback().await.unwrap();

            let mut tx = conn.begin().await.unwrap();
            let mut ours = Vec::with_capacity(CALLS);
            for i in 0..CALLS {
                let key = op.key(&(round, i)).unwrap();
                let started = Instant::now();
                let _ = op.run_in_transaction(&store, &mut tx, &key, None, async |tx| {
                    sqlx::query(update)
                        .execute(&mut *tx)
                        .await
                        .map_err(Error::store)?;
                    Ok::<_, Error>(i)
                })
                .await
                .unwrap();
                ours.push(started.elapsed());
            }
            tx.rollback().await.unwrap();
            rounds.push((body, [bare, savepointed, ours]));
        }
        for (round, (body, [bare, savepointed, ours])) in rounds.iter().enumerate() {
            println!(
                "round {round}, {body}: {CALLS} calls in one transaction, last {BLOCK} / first {BLOCK}: \
                 idem {:.2} ({:?} → {:?} per call); bodies in released savepoints {:.2}; bare bodies {:.2} \
                 (target: idem ≤ 2.00)",
                ratio(ours),
                block(&ours[..BLOCK]),
                block(&ours[CALLS - BLOCK..]),
                ratio(savepointed),
                ratio(bare),
            );
        }
        let _ = sqlx::query(&format!("DROP TABLE {table}, {table}_journal"))
            .execute(&pool)
            .await;
    });
}

/// The mean cost per call of a block.
fn block(times: &[Duration]) -> Duration {
    times.iter().sum::<Duration>() / times.len() as u32
}

/// The last block's mean over the first block's.
fn ratio(times: &[Duration]) -> f64 {
    block(&times[times.len() - BLOCK..]).as_secs_f64() / block(&times[..BLOCK]).as_secs_f64()
}
