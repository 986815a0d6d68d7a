//! The suite of claims in the caller's transaction, written once over the stores.

/// The suite over one store: `$store` is its type, `$conn` its connection, `[$p1, $p2]`
/// its first two placeholders, `$setup` an expression giving the store and a pool for the
/// callers' transactions for a test's name, or `None` when the server is unavailable (the
/// test is skipped, unless `IDEM_REQUIRE_SERVICES=1`).
macro_rules! suite {
    ($database:ident, $store:ty, $conn:ty, $pool:ty, [$p1:literal, $p2:literal], |$name:ident| $setup:expr) => {
        mod $database {
            use std::sync::Arc;

            use idem_runtime::{idempotent, Error, InFlight, Operation, Outcome};
            use idem_tests::scenarios::namespace;
            use idem_tests::{Child, Runs};
            use tokio::sync::{oneshot, Barrier};

            use super::{begin, begin_without_waiting};

            type Conn = $conn;

            /// A store, a pool for the callers' own transactions (begun as `begin` says),
            /// and a ledger: an account and a journal of transfers, in tables of its own.
            struct Db {
                store: $store,
                pool: $pool,
                accounts: String,
                journal: String,
            }

            async fn db(test: &str) -> Option<Db> {
                let $name = test;
                let (store, pool): ($store, $pool) = $setup?;
                let suffix = namespace(test).replace('.', "_");
                let db = Db {
                    store,
                    pool,
                    accounts: format!("accounts_{suffix}"),
                    journal: format!("journal_{suffix}"),
                };
                for statement in [
                    format!("CREATE TABLE {} (id INT PRIMARY KEY, balance BIGINT NOT NULL)", db.accounts),
                    format!("INSERT INTO {} (id, balance) VALUES (1, 0)", db.accounts),
                    format!("CREATE TABLE {} (transfer TEXT NOT NULL, task INT NOT NULL)", db.journal),
                ] {
                    sqlx::query(&statement).execute(&db.pool).await.unwrap();
                }
                Some(db)
            }

            impl Db {
                /// The transfer: the balance, and a journal line, on the caller's connection.
                async fn transfer(&self, tx: &mut Conn, transfer: &str, task: i32) -> Result<i64, Error> {
                    sqlx::query(&format!("UPDATE {} SET balance = balance + 100 WHERE id = 1", self.accounts))
                        .execute(&mut *tx)
                        .await
                        .map_err(Error::store)?;
                    sqlx::query(&format!(concat!("INSERT INTO {} (transfer, task) VALUES (", $p1, ", ", $p2, ")"), self.journal))
                        .bind(transfer)
                        .bind(task)
                        .execute(&mut *tx)
                        .await
                        .map_err(Error::store)?;
                    Ok(i64::from(task))
                }

                async fn balance(&self) -> i64 {
                    sqlx::query_scalar(&format!("SELECT balance FROM {} WHERE id = 1", self.accounts))
                        .fetch_one(&self.pool)
                        .await
                        .unwrap()
                }

                async fn lines(&self, transfer: &str) -> i64 {
                    sqlx::query_scalar(&format!(concat!("SELECT count(*) FROM {} WHERE transfer = ", $p1), self.journal))
                        .bind(transfer)
                        .fetch_one(&self.pool)
                        .await
                        .unwrap()
                }

                /// A call in a transaction of its own, committed unless the call failed.
                async fn call(&self, op: &Operation, transfer: &str, task: i32) -> Result<Outcome<i64>, Error> {
                    let key = op.key(&transfer).unwrap();
                    let mut tx = begin(&self.pool).await;
                    let outcome = op
                        .run_in_transaction(&self.store, &mut tx, &key, None, async |tx: &mut Conn| {
                            self.transfer(tx, transfer, task).await
                        })
                        .await;
                    match outcome {
                        Ok(_) => tx.commit().await.unwrap(),
                        Err(_) => tx.rollback().await.unwrap(),
                    }
                    outcome
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_duplicates_make_one_transfer_per_key() {
                let Some(db) = db("tx.transfers").await else { return };
                let db = Arc::new(db);
                let op = Operation::new(namespace("tx.transfers"));
                const TASKS: i32 = 4;
                const KEYS: usize = 25;
                let start = Arc::new(Barrier::new(TASKS as usize));
                let mut tasks = Vec::new();
                for task in 0..TASKS {
                    let (db, op, start) = (db.clone(), op.clone(), start.clone());
                    tasks.push(tokio::spawn(async move {
                        start.wait().await;
                        let mut answers = Vec::new();
                        for key in 0..KEYS {
                            let transfer = format!("t{key}");
                            answers.push(db.call(&op, &transfer, task).await.unwrap().into_inner());
                        }
                        answers
                    }));
                }
                let mut answers = Vec::new();
                for task in tasks {
                    answers.push(task.await.unwrap());
                }
                for key in 0..KEYS {
                    assert_eq!(db.lines(&format!("t{key}")).await, 1, "key {key}: one transfer");
                    let first = answers[0][key];
                    assert!(answers.iter().all(|a| a[key] == first), "key {key}: one value for every caller");
                }
                assert_eq!(db.balance().await, 100 * KEYS as i64, "every transfer once");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_err_leaves_nothing_and_the_retry_runs() {
                let Some(db) = db("tx.err").await else { return };
                let op = Operation::new(namespace("tx.err"));
                let key = op.key(&"t").unwrap();
                let mut tx = begin(&db.pool).await;
                let failed = op
                    .run_in_transaction(&db.store, &mut tx, &key, None, async |tx: &mut Conn| {
                        db.transfer(tx, "t", 1).await?;
                        Err::<i64, _>(Error::store("declined"))
                    })
                    .await;
                assert!(matches!(failed, Err(Error::Store(_))));
                // The caller's transaction is still usable, and commits nothing of the call.
                tx.commit().await.unwrap();
                assert_eq!(db.lines("t").await, 0);
                assert_eq!(db.balance().await, 0);
                assert_eq!(db.call(&op, "t", 2).await.unwrap(), Outcome::Executed(2));
                assert_eq!(db.call(&op, "t", 3).await.unwrap(), Outcome::Replayed(2));
                assert_eq!(db.lines("t").await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_rolled_back_transaction_leaves_nothing_and_the_retry_runs() {
                let Some(db) = db("tx.rollback").await else { return };
                let op = Operation::new(namespace("tx.rollback"));
                let key = op.key(&"t").unwrap();
                let mut tx = begin(&db.pool).await;
                let ran = op
                    .run_in_transaction(&db.store, &mut tx, &key, None, async |tx: &mut Conn| {
                        db.transfer(tx, "t", 1).await
                    })
                    .await;
                assert_eq!(ran.unwrap(), Outcome::Executed(1));
                tx.rollback().await.unwrap();
                assert_eq!(db.lines("t").await, 0);
                assert_eq!(db.call(&op, "t", 2).await.unwrap(), Outcome::Executed(2));
                assert_eq!(db.balance().await, 100);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_dropped_transaction_frees_its_key_at_once() {
                let Some(db) = db("tx.crash").await else { return };
                let op = Operation::new(namespace("tx.crash"));
                let key = op.key(&"t").unwrap();
                let mut tx = begin(&db.pool).await;
                // The call is dropped mid-body, and the transaction with it (a crash).
                let (entered, body_entered) = oneshot::channel();
                let call = op.run_in_transaction(&db.store, &mut tx, &key, None, async |tx: &mut Conn| {
                    db.transfer(tx, "t", 1).await?;
                    let _ = entered.send(());
                    std::future::pending::<Result<i64, Error>>().await
                });
                tokio::select! {
                    _ = call => unreachable!("the body never ends"),
                    _ = body_entered => {}
                }
                drop(tx);
                // No lease to wait out: the next call runs at once.
                assert_eq!(db.call(&op, "t", 2).await.unwrap(), Outcome::Executed(2));
                assert_eq!(db.lines("t").await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_duplicate_waits_for_the_commit_and_replays() {
                let Some(db) = db("tx.wait").await else { return };
                let db = Arc::new(db);
                let op = Operation::new(namespace("tx.wait"));
                let key = op.key(&"t").unwrap();
                let mut tx = begin(&db.pool).await;
                let ran = op
                    .run_in_transaction(&db.store, &mut tx, &key, None, async |tx: &mut Conn| {
                        db.transfer(tx, "t", 1).await
                    })
                    .await;
                assert_eq!(ran.unwrap(), Outcome::Executed(1));
                // Open and uncommitted: a duplicate in another transaction never sees it.
                let runs = Runs::default();
                let duplicate = {
                    let (db, op, runs) = (db.clone(), op.clone(), runs.clone());
                    tokio::spawn(async move {
                        let key = op.key(&"t").unwrap();
                        let mut tx = begin(&db.pool).await;
                        let outcome = op
                            .run_in_transaction(&db.store, &mut tx, &key, None, async |tx: &mut Conn| {
                                runs.hit();
                                db.transfer(tx, "t", 2).await
                            })
                            .await;
                        tx.commit().await.unwrap();
                        outcome
                    })
                };
                tx.commit().await.unwrap();
                assert_eq!(duplicate.await.unwrap().unwrap(), Outcome::Replayed(1));
                assert_eq!(runs.count(), 0);
                assert_eq!(db.lines("t").await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn reject_answers_in_progress_at_once_while_another_transaction_holds_the_key() {
                let Some(db) = db("tx.reject").await else { return };
                let db = Arc::new(db);
                let op = Operation::new(namespace("tx.reject"));
                let key = op.key(&"t").unwrap();
                let mut tx = begin(&db.pool).await;
                let held = op.run_in_transaction(&db.store, &mut tx, &key, None, async |tx: &mut Conn| {
                    db.transfer(tx, "t", 1).await
                })
                .await;
                assert_eq!(held.unwrap(), Outcome::Executed(1));
                let rejecting = op.clone().in_flight(InFlight::Reject);
                let runs = Runs::default();
                let duplicate = {
                    let (db, runs) = (db.clone(), runs.clone());
                    tokio::spawn(async move {
                        let mut other = begin_without_waiting(&db.pool).await;
                        let outcome = rejecting
                            .run_in_transaction(&db.store, &mut other, &key, None, async |tx: &mut Conn| {
                                runs.hit();
                                db.transfer(tx, "t", 2).await
                            })
                            .await;
                        let _ = other.rollback().await;
                        outcome
                    })
                };
                let rejected = duplicate.await.unwrap();
                assert!(matches!(rejected, Err(Error::InProgress)), "{rejected:?}");
                assert_eq!(runs.count(), 0);
                tx.commit().await.unwrap();
                assert_eq!(db.lines("t").await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn calls_nest_in_one_transaction_and_commit_together() {
                let Some(db) = db("tx.nest").await else { return };
                let op = Operation::new(namespace("tx.nest"));
                let (outer, inner) = (op.key(&"outer").unwrap(), op.key(&"inner").unwrap());
                let mut tx = begin(&db.pool).await;
                let nested = op
                    .run_in_transaction(&db.store, &mut tx, &outer, None, async |tx: &mut Conn| {
                        db.transfer(tx, "outer", 1).await?;
                        // Another key on the same connection, inside the body.
                        let inner = op
                            .run_in_transaction(&db.store, &mut *tx, &inner, None, async |tx: &mut Conn| {
                                db.transfer(tx, "inner", 2).await
                            })
                            .await?;
                        // The body's own key: held by this very call, refused at once.
                        let own = op
                            .run_in_transaction(&db.store, &mut *tx, &outer, None, async |tx: &mut Conn| {
                                db.transfer(tx, "outer", 3).await
                            })
                            .await;
                        assert!(matches!(own, Err(Error::InProgress)), "{own:?}");
                        // A failing call inside rolls back only its own writes.
                        let failed = op
                            .run_in_transaction(&db.store, &mut *tx, &op.key(&"failed").unwrap(), None, async |tx: &mut Conn| {
                                db.transfer(tx, "failed", 4).await?;
                                Err::<i64, _>(Error::store("declined"))
                            })
                            .await;
                        assert!(failed.is_err());
                        Ok::<_, Error>(inner.into_inner() * 10)
                    })
                    .await;
                assert_eq!(nested.unwrap(), Outcome::Executed(20));
                tx.commit().await.unwrap();
                assert_eq!((db.lines("outer").await, db.lines("inner").await, db.lines("failed").await), (1, 1, 0));
                assert_eq!(db.call(&op, "inner", 9).await.unwrap(), Outcome::Replayed(2));
                let mut tx = begin(&db.pool).await;
                let replayed = op
                    .run_in_transaction(&db.store, &mut tx, &outer, None, async |_: &mut Conn| Ok::<i64, Error>(0))
                    .await;
                assert_eq!(replayed.unwrap(), Outcome::Replayed(20));
                tx.commit().await.unwrap();
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_transaction_replays_an_ordinary_calls_record_and_the_reverse() {
                let Some(db) = db("tx.ordinary").await else { return };
                let op = Operation::new(namespace("tx.ordinary"));
                let key = op.key(&"t").unwrap();
                let ran = op.run(&db.store, &key, None, async { Ok::<i64, Error>(7) }).await;
                assert_eq!(ran.unwrap(), Outcome::Executed(7));
                assert_eq!(db.call(&op, "t", 1).await.unwrap(), Outcome::Replayed(7));
                assert_eq!(db.lines("t").await, 0);
                assert_eq!(db.call(&op, "u", 1).await.unwrap(), Outcome::Executed(1));
                let key = op.key(&"u").unwrap();
                let replayed = op.run(&db.store, &key, None, async { Ok::<i64, Error>(0) }).await;
                assert_eq!(replayed.unwrap(), Outcome::Replayed(1));
            }

            /// An ordinary call's claim that lapsed is taken over in a transaction, with a
            /// fencing token above its holder's, and replays once committed.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_lapsed_claim_is_taken_over_with_a_larger_token() {
                use idem_runtime::{Claim, Store};
                use std::time::Duration;

                let Some(db) = db("tx.lapsed").await else { return };
                let op = Operation::new(namespace("tx.lapsed"));
                let key = op.key(&"t").unwrap();
                let lease = Duration::from_millis(100);
                let Claim::Acquired { token: lapsed, .. } = db.store.claim(&idem_runtime::ClaimRequest::new(&key, lease)).await.unwrap() else {
                    panic!("a fresh key is free");
                };
                idem_tests::until_lapsed(&db.store, &key).await;
                let mut tx = begin(&db.pool).await;
                let ran = op
                    .run_in_transaction(&db.store, &mut tx, &key, None, async |tx: &mut Conn| {
                        let attempt = idem_runtime::attempt().expect("the body runs under a claim");
                        let token = attempt.token().await?;
                        assert!(token > lapsed, "{token:?} is not above the lapsed holder's {lapsed:?}");
                        db.transfer(tx, "t", 5).await
                    })
                    .await;
                assert_eq!(ran.unwrap(), Outcome::Executed(5));
                tx.commit().await.unwrap();
                assert_eq!(db.lines("t").await, 1);
                assert_eq!(db.call(&op, "t", 6).await.unwrap(), Outcome::Replayed(5));
            }

            /// The tables of a killed holder's run, named for its parent's.
            const KILLED_RUN: &str = "IDEM_TX_KILLED_RUN";

            #[tokio::test]
            #[ignore = "the child process of a_killed_holder_frees_its_key_at_once"]
            async fn killed_holder_child() {
                let suffix = std::env::var(KILLED_RUN).expect("run by a_killed_holder_frees_its_key_at_once");
                let $name = "tx.kill";
                let (store, pool): ($store, $pool) = $setup.unwrap();
                let db = Db {
                    store,
                    pool,
                    accounts: format!("accounts_{suffix}"),
                    journal: format!("journal_{suffix}"),
                };
                let op = killed_op(&suffix);
                let key = op.key(&"t").unwrap();
                let mut tx = begin(&db.pool).await;
                let _ = op
                    .run_in_transaction(&db.store, &mut tx, &key, None, async |tx: &mut Conn| {
                        db.transfer(tx, "t", 99).await?;
                        println!("claimed and written");
                        std::future::pending::<Result<i64, Error>>().await
                    })
                    .await;
            }

            /// A lease far longer than the wait: a key held by a lease would make the call
            /// fail after its wait, never run.
            fn killed_op(suffix: &str) -> Operation {
                Operation::new(format!("tx.kill.{suffix}"))
                    .lease(std::time::Duration::from_secs(3600))
                    .wait(std::time::Duration::from_secs(60))
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_killed_holder_frees_its_key_at_once() {
                let Some(db) = db("tx.kill").await else { return };
                let suffix = db.accounts.trim_start_matches("accounts_").to_string();
                let test = module_path!().split_once("::").unwrap().1;
                let mut holder = Child::start(
                    &format!("{test}::killed_holder_child"),
                    &[(KILLED_RUN, &suffix), (crate::PARENT, &std::process::id().to_string())],
                );
                holder.wait_for("claimed and written").await;
                holder.kill(""); // SIGKILL, mid-body, its transaction open
                // The database rolls the dead holder's transaction back: no lease to wait out.
                assert_eq!(db.call(&killed_op(&suffix), "t", 1).await.unwrap(), Outcome::Executed(1));
                assert_eq!(db.lines("t").await, 1, "nothing of the killed holder remains");
                assert_eq!(db.balance().await, 100);
            }

            #[idempotent(key = transfer, store = store, transaction = tx, ignore = (db, task), namespace = "tests.transactions.macro")]
            async fn by_attribute(store: &$store, tx: &mut $conn, db: &Db, transfer: &str, task: i32) -> Result<i64, Error> {
                db.transfer(tx, transfer, task).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_attribute_claims_in_the_transaction() {
                let Some(db) = db("tx.macro").await else { return };
                let transfer = namespace("tx.macro");
                let mut tx = begin(&db.pool).await;
                assert_eq!(by_attribute(&db.store, &mut tx, &db, &transfer, 1).await.unwrap(), 1);
                assert_eq!(by_attribute(&db.store, &mut tx, &db, &transfer, 2).await.unwrap(), 1);
                tx.commit().await.unwrap();
                let mut tx = begin(&db.pool).await;
                assert_eq!(by_attribute(&db.store, &mut tx, &db, &transfer, 3).await.unwrap(), 1);
                tx.rollback().await.unwrap();
                assert_eq!(db.lines(&transfer).await, 1);
            }
        }
    };
}
