//! P8 and P12: PostgreSQL, and a transfer in the caller's transaction.

use super::*;

// ---- P8: PostgreSQL ----------------------------------------------------------------------

pub(super) fn postgres(paths: &mut Paths, rt: &Runtime) {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = match rt.block_on(
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&url),
    ) {
        Ok(pool) => pool,
        Err(e) => return println!("skipped P8: postgresql at {url} is unreachable ({e})"),
    };
    // The store opens its second pool (completions) lazily, which needs the runtime.
    let _runtime = rt.enter();
    let store = PostgresStore::from_pool(pool.clone())
        .with_table("idem_bench")
        .unwrap();
    rt.block_on(async {
        store.migrate().await.unwrap();
        sqlx::query("CREATE TABLE IF NOT EXISTS idem_bench_raw (key bytea PRIMARY KEY, value bytea, expires_at timestamptz)")
            .execute(&pool)
            .await
            .unwrap();
    });
    let replay_id = fresh() + 2_000_000_000;
    rt.block_on(charge_postgres(&store, replay_id)).unwrap();
    let json = serde_json::to_vec(&receipt(1)).unwrap();
    let raw_key = hand_key(replay_id, "raw", 0);
    rt.block_on(
        sqlx::query("INSERT INTO idem_bench_raw VALUES ($1, $2, now() + interval '1 hour') ON CONFLICT DO NOTHING")
            .bind(&raw_key[..])
            .bind(&json)
            .execute(&pool),
    )
    .unwrap();

    paths.pair(
        "P8a first execution, postgres",
        on(rt, || async { charge_postgres(&store, fresh()).await.unwrap() }),
        on(rt, || async {
            let key = hand_key(fresh(), "raw", 0);
            sqlx::query_as::<_, (Vec<u8>,)>(
                "INSERT INTO idem_bench_raw VALUES ($1, $2, now() + interval '1 hour') \
                 ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value WHERE idem_bench_raw.expires_at <= now() \
                 RETURNING key",
            )
            .bind(&key[..])
            .bind(&json)
            .fetch_optional(&pool)
            .await
            .unwrap()
        }),
    );

    // P8b's baseline, and P8g's: the record read by its key.
    let raw_select = || async {
        sqlx::query_as::<_, (Vec<u8>,)>("SELECT value FROM idem_bench_raw WHERE key = $1")
            .bind(&raw_key[..])
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    paths.pair(
        "P8b replay, postgres",
        on(rt, || async {
            charge_postgres(&store, replay_id).await.unwrap()
        }),
        on(rt, raw_select),
    );
    // P13: a PostgreSQL replay through a memory tier in front, against a memory store's
    // replay and against the bare PostgreSQL replay of P8b. The tier's record was copied
    // into its memory tier by the first replay.
    let tiered = TieredStore::new(MemoryStore::new(), store.clone());
    let memory = MemoryStore::new();
    rt.block_on(async {
        charge_tiered(&tiered, replay_id).await.unwrap();
        assert!(charge_tiered(&tiered, replay_id).await.is_ok());
        charge_memory(&memory, replay_id).await.unwrap();
    });
    paths.pair(
        "P13a replay through a memory tier vs a memory replay",
        on(rt, || async {
            charge_tiered(&tiered, replay_id).await.unwrap()
        }),
        on(rt, || async {
            charge_memory(&memory, replay_id).await.unwrap()
        }),
    );
    paths.pair(
        "P13b replay through a memory tier vs a PostgreSQL replay",
        on(rt, || async {
            charge_tiered(&tiered, replay_id).await.unwrap()
        }),
        on(rt, || async {
            charge_postgres(&store, replay_id).await.unwrap()
        }),
    );
    // The floors of P8a and P8b under any design that keeps idem's guarantees, written by
    // hand on the baselines' own table. A first execution must commit its claim before the
    // body runs (else a crash forgets it and a retry runs the body beside it) and commit its
    // result after: two commits where the baseline has one.
    paths.pair(
        "P8f floor of a first execution: INSERT + UPDATE vs INSERT",
        on(rt, || async {
            let key = hand_key(fresh(), "raw", 0);
            sqlx::query("INSERT INTO idem_bench_raw VALUES ($1, NULL, now() + interval '1 minute') ON CONFLICT DO NOTHING")
                .bind(&key[..])
                .execute(&pool)
                .await
                .unwrap();
            sqlx::query("UPDATE idem_bench_raw SET value = $2, expires_at = now() + interval '1 hour' WHERE key = $1")
                .bind(&key[..])
                .bind(&json)
                .execute(&pool)
                .await
                .unwrap()
        }),
        on(rt, || async {
            let key = hand_key(fresh(), "raw", 0);
            sqlx::query("INSERT INTO idem_bench_raw VALUES ($1, $2, now() + interval '1 hour') ON CONFLICT DO NOTHING")
                .bind(&key[..])
                .bind(&json)
                .execute(&pool)
                .await
                .unwrap()
        }),
    );
    // A replay is the claim's statement finding a record: one round trip that reads the
    // record or, if there is none, claims the key. The least such a statement is, with no
    // token, fingerprint or expiry: it may write, so the server sets up the insert even
    // when it only reads.
    paths.pair(
        "P8g floor of a replay: read-or-claim in one statement vs SELECT",
        on(rt, || async {
            sqlx::query_as::<_, (Option<Vec<u8>>,)>(
                "WITH live AS (SELECT value FROM idem_bench_raw WHERE key = $1), \
                 claimed AS (INSERT INTO idem_bench_raw \
                    SELECT $1, NULL, now() + interval '1 minute' WHERE NOT EXISTS (SELECT 1 FROM live) \
                    ON CONFLICT DO NOTHING RETURNING value) \
                 SELECT value FROM live UNION ALL SELECT value FROM claimed",
            )
            .bind(&raw_key[..])
            .fetch_one(&pool)
            .await
            .unwrap()
        }),
        on(rt, raw_select),
    );
    transfers(paths, rt, &store, &pool, &json);
    rt.block_on(async {
        let _ = store.purge_expired().await;
        let _ = sqlx::query("DELETE FROM idem_bench_raw")
            .execute(&pool)
            .await;
        let _ = sqlx::query("DROP TABLE idem_bench_ledger")
            .execute(&pool)
            .await;
    });
}

// ---- P12: a transfer in the caller's transaction ------------------------------------------

/// The transfer both sides make: two `UPDATE`s of a ledger, on the caller's connection.
async fn transfer(tx: &mut sqlx::PgConnection) -> Result<u64, Error> {
    for (id, delta) in [(1, -1_i64), (2, 1)] {
        sqlx::query("UPDATE idem_bench_ledger SET balance = balance + $1 WHERE id = $2")
            .bind(delta)
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(Error::store)?;
    }
    Ok(1)
}

fn transfers(
    paths: &mut Paths,
    rt: &Runtime,
    store: &PostgresStore,
    pool: &sqlx::PgPool,
    json: &[u8],
) {
    rt.block_on(async {
        sqlx::query("CREATE TABLE IF NOT EXISTS idem_bench_ledger (id int PRIMARY KEY, balance bigint NOT NULL)")
            .execute(pool)
            .await
            .unwrap();
        sqlx::query("INSERT INTO idem_bench_ledger VALUES (1, 0), (2, 0) ON CONFLICT DO NOTHING")
            .execute(pool)
            .await
            .unwrap();
    });
    let op = Operation::new("bench.transfer");
    // Ours: the claim, the transfer and the record, all in the caller's one transaction.
    let in_transaction = || async {
        let key = op.key(&fresh()).unwrap();
        let mut tx = pool.begin().await.unwrap();
        let outcome = op
            .run_in_transaction(store, &mut tx, &key, None, async |tx| transfer(tx).await)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        outcome
    };
    // The baseline of P12a and of its floors: the transfer in a bare transaction.
    let bare = || async {
        let mut tx = pool.begin().await.unwrap();
        let moved = transfer(&mut tx).await.unwrap();
        tx.commit().await.unwrap();
        moved
    };
    paths.pair(
        "P12a transfer in a transaction, postgres",
        on(rt, in_transaction),
        on(rt, bare),
    );
    // What P12a's two round trips cost alone: a claim must reach the server before the body
    // runs, and the record after it; here both are empty (P12a's floor is P12g, below).
    paths.pair(
        "P12f floor: the transaction with two empty round trips vs without",
        on(rt, || async {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
            let moved = transfer(&mut tx).await.unwrap();
            sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
            tx.commit().await.unwrap();
            moved
        }),
        on(rt, bare),
    );
    // The floor with the record written: what the guarantees need inside the transaction. A
    // savepoint (an `Err` undoes the call's writes, not the caller's earlier ones) and the
    // claim's row in the message before the body, the result and the savepoint's release in
    // the message after it, on the baselines' own table: no token, no lock timeout, no
    // expiry check.
    paths.pair(
        "P12g floor: the transaction with a savepoint, an INSERT and an UPDATE vs without",
        on(rt, || async {
            let key = hex::encode(hand_key(fresh(), "raw", 0));
            let mut tx = pool.begin().await.unwrap();
            let claim = format!(
                "SAVEPOINT floor; INSERT INTO idem_bench_raw VALUES (decode('{key}', 'hex'), NULL, \
                 now() + interval '1 minute') ON CONFLICT DO NOTHING RETURNING key"
            );
            sqlx::Executor::fetch_one(&mut *tx, sqlx::raw_sql(&claim))
                .await
                .unwrap();
            let moved = transfer(&mut tx).await.unwrap();
            let record = format!(
                "UPDATE idem_bench_raw SET value = decode('{}', 'hex'), \
                 expires_at = now() + interval '1 hour' WHERE key = decode('{key}', 'hex') RETURNING true; \
                 RELEASE SAVEPOINT floor",
                hex::encode(json)
            );
            sqlx::Executor::fetch_all(&mut *tx, sqlx::raw_sql(&record))
                .await
                .unwrap();
            tx.commit().await.unwrap();
            moved
        }),
        on(rt, bare),
    );
    // The same transfer through the store's own claims: claim, the transaction, complete.
    paths.pair(
        "P12b same, against the non-transactional store",
        on(rt, in_transaction),
        on(rt, || async {
            let key = op.key(&fresh()).unwrap();
            op.run(store, &key, None, async {
                let mut tx = pool.begin().await.map_err(Error::store)?;
                let moved = transfer(&mut tx).await?;
                tx.commit().await.map_err(Error::store)?;
                Ok::<_, Error>(moved)
            })
            .await
            .unwrap()
        }),
    );
}
