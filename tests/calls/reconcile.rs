//! `reconcile`: the outcome nobody knows. A call that takes its key over from a claim that
//! was never settled (its holder died or stalled past its lease, or an operator released
//! it) asks the effect's destination before its body, and only then. The clock is tokio's,
//! paused: the memory store's leases follow it, so a lease runs out exactly when the test
//! says, on any machine.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::admin::{Admin, Release};
use idem_runtime::{
    idempotent, reconcile, Claim, ClaimRequest, Error, InFlight, Key, MemoryStore, Operation,
    Outcome, Store,
};
use idem_tests::scenarios::namespace;
use tokio::sync::Notify;

const LEASE: Duration = Duration::from_secs(1);

/// A holder that died mid-body: a claim of `key` taken and never settled.
async fn died_holding(store: &MemoryStore, key: &Key) {
    let claim = store.claim(&ClaimRequest::new(key, LEASE)).await.unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
}

/// What a destination was asked, and what the body did.
#[derive(Default)]
struct Counts {
    asked: AtomicU32,
    ran: AtomicU32,
}

impl Counts {
    fn asked(&self) -> u32 {
        self.asked.load(Ordering::SeqCst)
    }

    fn ran(&self) -> u32 {
        self.ran.load(Ordering::SeqCst)
    }

    /// A body that asks the destination first (`found` is what it finds), then runs,
    /// answering `ran`.
    async fn body(&self, found: Result<Option<u32>, Error>, ran: u32) -> Result<u32, Error> {
        let lookup = async {
            self.asked.fetch_add(1, Ordering::SeqCst);
            found
        };
        if let Some(effect) = reconcile(lookup).await? {
            return Ok(effect);
        }
        self.ran.fetch_add(1, Ordering::SeqCst);
        Ok(ran)
    }
}

#[tokio::test(start_paused = true)]
async fn a_takeover_asks_the_destination_and_replays_what_it_found() {
    let store = MemoryStore::new();
    let op = Operation::new(namespace("reconcile.found")).lease(LEASE);
    let key = op.key(&"evt_1").unwrap();
    died_holding(&store, &key).await;
    tokio::time::sleep(LEASE * 2).await;

    let counts = Counts::default();
    let first = op
        .run(&store, &key, None, counts.body(Ok(Some(7)), 8))
        .await
        .unwrap();
    assert_eq!(
        first,
        Outcome::Replayed(7),
        "the effect found is answered as a replay"
    );
    assert_eq!((counts.asked(), counts.ran()), (1, 0), "asked, not run");
    let again = op
        .run(&store, &key, None, counts.body(Ok(Some(9)), 10))
        .await
        .unwrap();
    assert_eq!(again, Outcome::Replayed(7), "and recorded");
    assert_eq!((counts.asked(), counts.ran()), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn when_the_destination_has_nothing_the_body_runs_once() {
    let store = MemoryStore::new();
    let op = Operation::new(namespace("reconcile.absent")).lease(LEASE);
    let key = op.key(&"evt_2").unwrap();
    died_holding(&store, &key).await;
    tokio::time::sleep(LEASE * 2).await;

    let counts = Counts::default();
    let first = op.run(&store, &key, None, counts.body(Ok(None), 8)).await;
    assert_eq!(first.unwrap(), Outcome::Executed(8));
    let again = op.run(&store, &key, None, counts.body(Ok(None), 9)).await;
    assert_eq!(again.unwrap(), Outcome::Replayed(8));
    assert_eq!((counts.asked(), counts.ran()), (1, 1));
}

/// Never on a fresh key or a key an `Err` released: nothing there is in doubt. (Nor after
/// a record expired: the conformance suite holds every store to that, since the memory
/// store's TTLs follow the real clock, not this test's paused one.)
#[tokio::test(start_paused = true)]
async fn a_fresh_key_and_a_released_one_never_ask() {
    let store = MemoryStore::new();
    let op = Operation::new(namespace("reconcile.never")).lease(LEASE);
    let key = op.key(&"evt_3").unwrap();
    let counts = Counts::default();

    let failed = op
        .run(&store, &key, None, async {
            counts.body(Ok(Some(1)), 0).await?;
            Err::<u32, _>(Error::store("the ledger is down"))
        })
        .await;
    assert!(failed.is_err(), "a fresh key");
    let retried = op
        .run(&store, &key, None, counts.body(Ok(Some(1)), 2))
        .await;
    assert_eq!(retried.unwrap(), Outcome::Executed(2), "a released key");
    assert_eq!(counts.asked(), 0, "the destination was never asked");
    assert_eq!(counts.ran(), 2);
}

/// A lookup that fails fails the call, and leaves the key to lapse rather than releasing
/// it: the next attempt, once the lease is over, takes it over and asks again.
#[tokio::test(start_paused = true)]
async fn a_failed_lookup_leaves_the_key_in_doubt_for_the_next_attempt() {
    let store = MemoryStore::new();
    let op = Operation::new(namespace("reconcile.failed"))
        .lease(LEASE)
        .in_flight(InFlight::Reject);
    let key = op.key(&"evt_4").unwrap();
    died_holding(&store, &key).await;
    tokio::time::sleep(LEASE * 2).await;

    let counts = Counts::default();
    let down = Err(Error::store("the ledger cannot be reached"));
    let failed = op.run(&store, &key, None, counts.body(down, 1)).await;
    assert!(matches!(failed, Err(Error::Store(_))), "{failed:?}");
    let at_once = op.run(&store, &key, None, counts.body(Ok(None), 1)).await;
    assert!(
        matches!(at_once, Err(Error::InProgress)),
        "not released: {at_once:?}"
    );
    tokio::time::sleep(LEASE * 2).await;
    let later = op
        .run(&store, &key, None, counts.body(Ok(Some(5)), 1))
        .await;
    assert_eq!(later.unwrap(), Outcome::Replayed(5), "asked again");
    assert_eq!((counts.asked(), counts.ran()), (2, 0));
}

/// A call whose claim an operator released while its lookup ran records nothing: the
/// call that took the key over (told so: the operator's release left the outcome in
/// doubt) asks the destination itself, and its answer is the record.
#[tokio::test(start_paused = true)]
async fn a_lookup_whose_claim_was_taken_over_records_nothing() {
    let store = MemoryStore::new();
    let op = Operation::new(namespace("reconcile.fenced")).lease(LEASE);
    let key = op.key(&"evt_5").unwrap();
    died_holding(&store, &key).await;
    tokio::time::sleep(LEASE * 2).await;

    let (asking, answer) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let first = tokio::spawn({
        let (store, op, asking, answer) =
            (store.clone(), op.clone(), asking.clone(), answer.clone());
        async move {
            op.run(&store, &key, None, async {
                let lookup = async {
                    asking.notify_one();
                    answer.notified().await;
                    Ok::<_, Error>(Some(1_u32))
                };
                match reconcile(lookup).await? {
                    Some(effect) => Ok(effect),
                    None => Ok(0),
                }
            })
            .await
        }
    });
    asking.notified().await;
    let entry = store.inspect(&key).await.unwrap().expect("held");
    let verdict = Admin::release(&store, &key, entry.token().unwrap(), Release::Force).await;
    assert_eq!(verdict.unwrap(), idem_runtime::admin::Verdict::Done);

    let counts = Counts::default();
    let second = op
        .run(&store, &key, None, counts.body(Ok(Some(2)), 3))
        .await;
    assert_eq!(second.unwrap(), Outcome::Replayed(2));
    assert_eq!(
        counts.asked(),
        1,
        "the key was in doubt again after the release"
    );

    answer.notify_one();
    let first = first.await.unwrap();
    assert!(
        matches!(first, Err(Error::Unrecorded(_))),
        "the fenced lookup's value is not recorded: {first:?}"
    );
    let replay = op.run(&store, &key, None, counts.body(Ok(None), 4)).await;
    assert_eq!(replay.unwrap(), Outcome::Replayed(2));
}

/// What a ledger would be asked: whether event `id` was credited.
async fn find_credit(ledger: &Counts, id: &str) -> Result<Option<String>, Error> {
    ledger.asked.fetch_add(1, Ordering::SeqCst);
    Ok(Some(format!("credited {id} before")))
}

#[idempotent(key = id, store = store, lease = "1s", ignore = ledger, namespace = "reconcile.attribute",
             reconcile = find_credit(ledger, id))]
async fn credit(store: &MemoryStore, ledger: &Counts, id: &str) -> Result<String, Error> {
    ledger.ran.fetch_add(1, Ordering::SeqCst);
    Ok(format!("credited {id}"))
}

#[tokio::test(start_paused = true)]
async fn the_attribute_asks_only_after_a_takeover() {
    let store = MemoryStore::new();
    let ledger = Counts::default();
    assert_eq!(
        credit(&store, &ledger, "evt_a").await.unwrap(),
        "credited evt_a"
    );
    assert_eq!((ledger.asked(), ledger.ran()), (0, 1), "a fresh key runs");

    let key = Operation::new("reconcile.attribute").key(&"evt_b").unwrap();
    died_holding(&store, &key).await;
    tokio::time::sleep(LEASE * 2).await;
    let outcome = credit_outcome(&store, &ledger, "evt_b").await.unwrap();
    assert_eq!(
        outcome,
        Outcome::Replayed("credited evt_b before".to_owned())
    );
    assert_eq!((ledger.asked(), ledger.ran()), (1, 1));
}

/// The effect in PostgreSQL, the record in Redis: the window between the two, closed by
/// `reconcile`. A child process of this binary credits an event (a row in PostgreSQL,
/// committed), says so, and is SIGKILLed before its record reaches Redis; the retry, in
/// this process, takes the key over once the child's lease has run out.
mod killed_between_effect_and_record {
    use super::*;
    use idem_runtime::RedisStore;
    use idem_tests::{postgres_url, redis_store, Child};

    const NAMESPACE: &str = "IDEM_RECONCILE_NAMESPACE";
    const EVENT: &str = "IDEM_RECONCILE_EVENT";
    const CHILD_LEASE: Duration = Duration::from_millis(500);

    async fn ledger() -> Option<sqlx::PgPool> {
        let pool = match sqlx::PgPool::connect(&postgres_url()).await {
            Ok(pool) => pool,
            Err(err) => {
                idem_tests::unavailable::<()>("postgresql", err);
                return None;
            }
        };
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.tests.reconcile_credits'))")
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS reconcile_credits (event text NOT NULL, credit bigint NOT NULL)",
        )
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        Some(pool)
    }

    /// Credits `event`: a row, committed at once (no transaction of the store's: the
    /// record is in Redis). The credit's number is the row's.
    async fn credit(pool: &sqlx::PgPool, event: &str, credit: i64) -> Result<i64, Error> {
        sqlx::query("INSERT INTO reconcile_credits (event, credit) VALUES ($1, $2)")
            .bind(event)
            .bind(credit)
            .execute(pool)
            .await
            .map_err(Error::store)?;
        Ok(credit)
    }

    /// What the ledger says of `event`: its credit, if it has one.
    async fn find_credit(pool: &sqlx::PgPool, event: &str) -> Result<Option<i64>, Error> {
        sqlx::query_scalar("SELECT credit FROM reconcile_credits WHERE event = $1 LIMIT 1")
            .bind(event)
            .fetch_optional(pool)
            .await
            .map_err(Error::store)
    }

    async fn credits(pool: &sqlx::PgPool, event: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM reconcile_credits WHERE event = $1")
            .bind(event)
            .fetch_one(pool)
            .await
            .unwrap()
    }

    /// The child: claims the event's key on Redis, commits the credit, says so, and waits
    /// to be killed before its record is written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a child of the tests below, SIGKILLed between its effect and its record"]
    async fn child() {
        let store = RedisStore::connect(&idem_tests::redis_url()).await.unwrap();
        let pool = ledger().await.unwrap();
        let op = Operation::new(std::env::var(NAMESPACE).unwrap()).lease(CHILD_LEASE);
        let event = std::env::var(EVENT).unwrap();
        let key = op.key(&event).unwrap();
        let _ = op
            .run(&store, &key, None, async {
                credit(&pool, &event, 1).await?;
                println!("committed");
                std::future::pending::<()>().await;
                Ok::<_, Error>(0)
            })
            .await;
    }

    /// Runs the child on a fresh event until it committed its credit, SIGKILLs it, and
    /// returns what the retry needs.
    async fn killed_after_its_credit(
        test: &str,
    ) -> Option<(RedisStore, sqlx::PgPool, Operation, String)> {
        let store = redis_store().await?;
        let pool = ledger().await?;
        let namespace = namespace(test);
        let event = namespace.replace("scenario.", "evt.");
        let mut child = Child::start(
            "killed_between_effect_and_record::child",
            &[(NAMESPACE, &namespace), (EVENT, &event)],
        );
        child.wait_for("committed").await;
        child.kill("");
        assert_eq!(
            credits(&pool, &event).await,
            1,
            "the child's credit committed"
        );
        let op = Operation::new(namespace)
            .lease(CHILD_LEASE)
            .wait(Duration::from_secs(30));
        Some((store, pool, op, event))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_reconcile_the_effect_happens_once_and_the_retry_replays_it() {
        let Some((store, pool, op, event)) = killed_after_its_credit("reconcile.killed").await
        else {
            return;
        };
        let key = op.key(&event).unwrap();
        // Waits out the dead holder's lease, takes the key over, asks the ledger.
        let retried = op
            .run(&store, &key, None, async {
                if let Some(found) = reconcile(find_credit(&pool, &event)).await? {
                    return Ok(found);
                }
                credit(&pool, &event, 2).await
            })
            .await
            .unwrap();
        assert_eq!(
            retried,
            Outcome::Replayed(1),
            "the child's credit, found and recorded"
        );
        assert_eq!(credits(&pool, &event).await, 1, "credited once");
        let again = op
            .run(&store, &key, None, credit(&pool, &event, 3))
            .await
            .unwrap();
        assert_eq!(again, Outcome::Replayed(1));
        assert_eq!(credits(&pool, &event).await, 1);
        store.remove(&key).await.unwrap();
    }

    /// Without `reconcile`, the same kill credits twice: the window the README states for
    /// an effect outside the store's database.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_reconcile_the_effect_happens_twice() {
        let Some((store, pool, op, event)) =
            killed_after_its_credit("reconcile.killed.blind").await
        else {
            return;
        };
        let key = op.key(&event).unwrap();
        let retried = op
            .run(&store, &key, None, credit(&pool, &event, 2))
            .await
            .unwrap();
        assert_eq!(retried, Outcome::Executed(2));
        assert_eq!(credits(&pool, &event).await, 2, "credited twice");
        store.remove(&key).await.unwrap();
    }
}
