//! Resumable steps (`idem_runtime::step`): a retry replays the steps that finished and runs
//! the first that did not; loops, payloads, unkeyed and outside calls, a zombie holder's
//! steps, a SIGKILL between steps, and steps inside a database transaction.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::{
    attempt, idempotent, step, Error, MemoryStore, Operation, Outcome, SqliteStore,
};
use idem_tests::scenarios::namespace;
use idem_tests::{postgres_store, Child, Probe};
use tokio::sync::{oneshot, Notify};

mod costs;
mod fences;
mod stores;
mod values;

/// Counts the runs of one step's future and hands out its values: `name:run`.
#[derive(Clone, Default)]
struct Effect(Arc<AtomicU32>);

impl Effect {
    async fn run(&self, name: &str) -> Result<String, Error> {
        let run = self.0.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(format!("{name}:{run}"))
    }

    fn runs(&self) -> u32 {
        self.0.load(Ordering::SeqCst)
    }
}

#[tokio::test]
async fn recorded_steps_replay_and_the_first_unfinished_one_runs() {
    let store = MemoryStore::new();
    let op = Operation::new(namespace("steps_replay"));
    let key = op.key(&"order-1").unwrap();
    let (reserve, charge, email) = (Effect::default(), Effect::default(), Effect::default());
    let checkout = |email_fails: bool| {
        let (reserve, charge, email) = (reserve.clone(), charge.clone(), email.clone());
        async move {
            let hold = step("reserve", reserve.run("reserve")).await?;
            let paid = step("charge", charge.run("charge")).await?;
            let sent = step("email", async {
                let sent = email.run("email").await?;
                if email_fails {
                    return Err(Error::store("the mail server is down"));
                }
                Ok(sent)
            })
            .await?;
            Ok::<_, Error>(format!("{hold} {paid} {sent}"))
        }
    };

    let first = op.run(&store, &key, None, checkout(true)).await;
    assert!(matches!(first, Err(Error::Store(_))), "{first:?}");
    assert_eq!((reserve.runs(), charge.runs(), email.runs()), (1, 1, 1));

    let second = op.run(&store, &key, None, checkout(false)).await.unwrap();
    assert_eq!(
        second,
        Outcome::Executed("reserve:1 charge:1 email:2".to_string()),
        "the recorded steps replay their values; the failed one ran again"
    );
    assert_eq!((reserve.runs(), charge.runs(), email.runs()), (1, 1, 2));

    let third = op.run(&store, &key, None, checkout(false)).await.unwrap();
    assert_eq!(
        third,
        Outcome::Replayed("reserve:1 charge:1 email:2".to_string())
    );
    assert_eq!((reserve.runs(), charge.runs(), email.runs()), (1, 1, 2));
}

#[tokio::test]
async fn a_step_in_a_loop_is_numbered_in_order() {
    let store = MemoryStore::new();
    let op = Operation::new(namespace("steps_loop"));
    let key = op.key(&"batch-1").unwrap();
    let runs: Vec<Effect> = (0..4).map(|_| Effect::default()).collect();
    let batch = |fail_at: Option<usize>| {
        let runs = runs.clone();
        async move {
            let mut shipped = Vec::new();
            for (item, effect) in runs.iter().enumerate() {
                let value = step("ship", async {
                    if fail_at == Some(item) {
                        return Err(Error::store("the carrier is down"));
                    }
                    effect.run(&format!("item{item}")).await
                })
                .await?;
                shipped.push(value);
            }
            Ok::<_, Error>(shipped)
        }
    };
    assert!(op.run(&store, &key, None, batch(Some(2))).await.is_err());
    let done = op.run(&store, &key, None, batch(None)).await.unwrap();
    assert_eq!(
        done.into_inner(),
        ["item0:1", "item1:1", "item2:1", "item3:1"],
        "ship#0 and ship#1 replayed, ship#2 and ship#3 ran"
    );
    let counts: Vec<u32> = runs.iter().map(Effect::runs).collect();
    assert_eq!(counts, [1, 1, 1, 1], "each item shipped once");
}

#[tokio::test]
async fn steps_joined_concurrently_are_numbered_as_written() {
    let store = MemoryStore::new();
    let op = Operation::new(namespace("steps_joined"));
    let key = op.key(&"join-1").unwrap();
    let (a, b) = (Effect::default(), Effect::default());
    let body = |fail: bool| {
        let (a, b) = (a.clone(), b.clone());
        async move {
            // Created in order a, b; b finishes first.
            let (gate_tx, gate_rx) = oneshot::channel::<()>();
            let first = step("fetch", async {
                gate_rx.await.ok();
                a.run("a").await
            });
            let second = step("fetch", async {
                let value = b.run("b").await;
                gate_tx.send(()).ok();
                value
            });
            let (first, second) = tokio::join!(first, second);
            if fail {
                return Err(Error::store("after both"));
            }
            Ok::<_, Error>((first?, second?))
        }
    };
    assert!(op.run(&store, &key, None, body(true)).await.is_err());
    let done = op.run(&store, &key, None, body(false)).await.unwrap();
    assert_eq!(done.into_inner(), ("a:1".to_string(), "b:1".to_string()));
    assert_eq!((a.runs(), b.runs()), (1, 1));
}

#[tokio::test]
async fn another_payload_replays_none_of_the_first_ones_steps() {
    let store = MemoryStore::new();
    let op = Operation::new(namespace("steps_payload"));
    let key = op.key(&"order-2").unwrap();
    let charge = Effect::default();
    let body = |fail: bool| {
        let charge = charge.clone();
        async move {
            let paid = step("charge", charge.run("charge")).await?;
            if fail {
                return Err(Error::store("later"));
            }
            Ok::<_, Error>(paid)
        }
    };
    let cents = |n: u64| idem_runtime::Fingerprint::of(&n).unwrap();
    assert!(op
        .run(&store, &key, Some(&cents(100)), body(true))
        .await
        .is_err());
    let other = op.run(&store, &key, Some(&cents(250)), body(false)).await;
    assert_eq!(
        other.unwrap().into_inner(),
        "charge:2",
        "a new payload charges anew"
    );
    assert_eq!(charge.runs(), 2);
}

#[tokio::test]
async fn a_steps_attempt_is_its_own_and_the_same_on_every_attempt() {
    let store = MemoryStore::new();
    let op = Operation::new(namespace("steps_attempt"));
    let key = op.key(&"order-3").unwrap();
    let body = |fail: bool| async move {
        let call = attempt().expect("in the body").key().to_hex();
        let inside = step("downstream", async {
            let attempt = attempt().expect("in the step");
            attempt.token().await?;
            Ok::<_, Error>(attempt.key().to_hex())
        })
        .await?;
        let again = step("downstream", async {
            Ok::<_, Error>(attempt().expect("in the step").key().to_hex())
        })
        .await?;
        if fail {
            return Err(Error::store("later"));
        }
        Ok::<_, Error>((call, inside, again))
    };
    let first = op
        .run(&store, &key, None, body(false))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.0, key.to_hex());
    assert_ne!(first.1, first.0, "a step's key is not the call's");
    assert_ne!(first.1, first.2, "two occurrences of a name have two keys");

    // The same keys on another attempt (another store, so that the call runs again).
    let other = MemoryStore::new();
    let second = op
        .run(&other, &key, None, body(false))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        first, second,
        "step keys are deterministic: one downstream key per step"
    );
}

#[idempotent(namespace = "steps.unkeyed.v1", key = id, ignore = effect)]
async fn maybe_keyed(id: Option<u64>, effect: &Effect) -> Result<String, Error> {
    step("effect", effect.run("effect")).await
}

#[tokio::test]
async fn in_a_call_without_a_key_a_step_is_a_plain_future() {
    let effect = Effect::default();
    assert_eq!(maybe_keyed(None, &effect).await.unwrap(), "effect:1");
    assert_eq!(maybe_keyed(None, &effect).await.unwrap(), "effect:2");
    let id = u64::from(std::process::id()) << 20 | u64::from(rand_seed());
    assert_eq!(maybe_keyed(Some(id), &effect).await.unwrap(), "effect:3");
    assert_eq!(maybe_keyed(Some(id), &effect).await.unwrap(), "effect:3");
    assert_eq!(effect.runs(), 3);
}

/// A number that differs between runs of the suite, for keys in the process-wide default
/// store.
fn rand_seed() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
}

#[tokio::test]
async fn outside_every_call_a_step_is_a_config_error_and_does_not_run() {
    let effect = Effect::default();
    let outside = step("charge", effect.run("charge")).await;
    match outside {
        Err(Error::Config(why)) => {
            assert!(why.to_string().contains("`step(\"charge\", …)`"), "{why}")
        }
        other => panic!("expected a config error, got {other:?}"),
    }
    // A task the body spawns is outside the body too.
    let store = MemoryStore::new();
    let op = Operation::new(namespace("steps_outside"));
    let key = op.key(&1).unwrap();
    let spawned = op
        .run(&store, &key, None, async {
            let effect = Effect::default();
            let task = tokio::spawn(async move { step("x", effect.run("x")).await });
            Ok::<_, Error>(matches!(task.await.unwrap(), Err(Error::Config(_))))
        })
        .await
        .unwrap();
    assert!(spawned.into_inner());
    assert_eq!(effect.runs(), 0);
}

/// A holder whose renewals fail until its key is taken over and completed: when it comes
/// back to run its next step, it does not start it, and gets a store error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_key_was_taken_over_does_not_start_its_next_step() {
    let store = MemoryStore::new();
    let zombie_store = Probe::apart(store.clone());
    let op = Operation::new(namespace("steps_zombie_start"))
        .lease(Duration::from_secs(1))
        .wait(Duration::from_secs(60));
    let key = op.key(&"order-4").unwrap();
    let (one, two) = (Effect::default(), Effect::default());
    let (paused_tx, paused) = oneshot::channel();
    let resume = Arc::new(Notify::new());

    let zombie = tokio::spawn({
        let (op, one, two, resume) = (op.clone(), one.clone(), two.clone(), resume.clone());
        let zombie_store = zombie_store.clone();
        async move {
            op.run(&zombie_store, &key, None, async {
                step("one", one.run("one")).await?;
                zombie_store.fail_renewals(usize::MAX);
                paused_tx.send(()).unwrap();
                resume.notified().await;
                step("two", two.run("two")).await
            })
            .await
        }
    });
    paused.await.unwrap();
    // The new holder waits for the lease to lapse, replays step one, and completes.
    let taken = op
        .run(&store, &key, None, async {
            step("one", one.run("one")).await?;
            Ok::<_, Error>("the new holder's".to_string())
        })
        .await
        .unwrap();
    assert_eq!(taken, Outcome::Executed("the new holder's".to_string()));
    resume.notify_one();
    let zombie = zombie.await.unwrap();
    assert!(matches!(zombie, Err(Error::Store(_))), "{zombie:?}");
    assert_eq!((one.runs(), two.runs()), (1, 0), "step two never started");
}

/// A holder running a step when its key is taken over: the new holder runs the step after
/// the old one's lease lapses, and the old holder's record of it is refused when it
/// returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_key_was_taken_over_cannot_record_the_step_it_ran() {
    let store = MemoryStore::new();
    let zombie_store = Probe::apart(store.clone());
    let op = Operation::new(namespace("steps_zombie_record"))
        .lease(Duration::from_millis(500))
        .wait(Duration::from_secs(60));
    let key = op.key(&"order-5").unwrap();
    let charge = Effect::default();
    let (inside_tx, inside) = oneshot::channel();
    let resume = Arc::new(Notify::new());

    let zombie = tokio::spawn({
        let (op, charge, resume) = (op.clone(), charge.clone(), resume.clone());
        let zombie_store = zombie_store.clone();
        async move {
            op.run(&zombie_store, &key, None, async {
                let paid = step("charge", async {
                    zombie_store.fail_renewals(usize::MAX);
                    inside_tx.send(()).unwrap();
                    resume.notified().await;
                    zombie_store.fail_renewals(0);
                    charge.run("zombie").await
                })
                .await?;
                Ok::<_, Error>(paid)
            })
            .await
        }
    });
    inside.await.unwrap();
    let new_holder = op
        .run(&store, &key, None, async {
            step("charge", charge.run("new")).await
        })
        .await
        .unwrap();
    assert_eq!(new_holder, Outcome::Executed("new:1".to_string()));
    resume.notify_one();
    let zombie = zombie.await.unwrap();
    // Its step ran and could not be recorded: `Unrecorded`, never `Store` (which says
    // nothing ran).
    assert!(matches!(zombie, Err(Error::Unrecorded(_))), "{zombie:?}");
    assert_eq!(
        charge.runs(),
        2,
        "the zombie's future ran: its effect is the caveat"
    );

    // Every later call replays the new holder's outcome, recorded by one body.
    let later = op
        .run(&store, &key, None, async {
            step("charge", charge.run("later")).await
        })
        .await
        .unwrap();
    assert_eq!(later, Outcome::Replayed("new:1".to_string()));
}

/// The SQLite file a crashed child and its parent share.
fn crash_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// The checkout of the crash test: step one appends to the effects file; step two prints
/// that it started, then (in the child) hangs until it is killed.
async fn crashing_checkout(
    store: &SqliteStore,
    namespace: &str,
    effects: &Path,
    hang: bool,
) -> Result<String, Error> {
    let op = Operation::new(namespace.to_string())
        .lease(Duration::from_secs(1))
        .wait(Duration::from_secs(60));
    let key = op.key(&"order-6").unwrap();
    let append = |what: &'static str| {
        let effects = effects.to_path_buf();
        async move {
            use std::io::Write;
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&effects)
                .unwrap();
            writeln!(file, "{what}").unwrap();
            file.sync_all().unwrap();
            Ok::<_, Error>(what.to_string())
        }
    };
    op.run(store, &key, None, async {
        let one = step("one", append("one")).await?;
        let two = step("two", async {
            println!("in step two");
            if hang {
                std::future::pending::<()>().await;
            }
            append("two").await
        })
        .await?;
        Ok::<_, Error>(format!("{one}+{two}"))
    })
    .await
    .map(Outcome::into_inner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child of a_sigkill_between_steps_resumes_at_the_step_it_did_not_finish"]
async fn crashing_child() {
    let db = std::env::var("IDEM_STEPS_DB").unwrap();
    let store = SqliteStore::open(&db).await.unwrap();
    let namespace = std::env::var("IDEM_STEPS_NAMESPACE").unwrap();
    let effects = PathBuf::from(std::env::var("IDEM_STEPS_EFFECTS").unwrap());
    let _ = crashing_checkout(&store, &namespace, &effects, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkill_between_steps_resumes_at_the_step_it_did_not_finish() {
    let db = crash_file("steps-crash.db");
    let store = SqliteStore::open(&db).await.unwrap();
    store.migrate().await.unwrap();
    let namespace = namespace("steps_crash");
    let effects = crash_file(&format!("{namespace}.effects"));
    let mut child = Child::start(
        "crashing_child",
        &[
            ("IDEM_STEPS_DB", db.to_str().unwrap()),
            ("IDEM_STEPS_NAMESPACE", &namespace),
            ("IDEM_STEPS_EFFECTS", effects.to_str().unwrap()),
        ],
    );
    child.wait_for("in step two").await;
    child.kill("");

    let done = crashing_checkout(&store, &namespace, &effects, false)
        .await
        .unwrap();
    assert_eq!(done, "one+two");
    let written = std::fs::read_to_string(&effects).unwrap();
    std::fs::remove_file(&effects).unwrap();
    assert_eq!(
        written, "one\ntwo\n",
        "step one ran once, in the killed process; step two once, here"
    );
}

/// Inside `transaction =`, a step runs unrecorded (its record could not be fenced by a
/// claim no other connection sees, and SQLite's transaction holds the only write lock):
/// an attempt that rolls back runs the step again on the retry, under the same
/// `attempt().key()` for the downstream service to dedupe. Never a wait for the lock its
/// own transaction holds, on any of the three databases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_transaction_a_step_runs_under_the_same_key_on_every_attempt() {
    if let Some(store) = postgres_store().await {
        let pool = store.pool().clone();
        in_a_transaction("postgres", &store, || pool.begin()).await;
    }
    let store = stores::sqlite_store("transaction").await;
    let pool = store.pool().clone();
    in_a_transaction("sqlite", &store, || pool.begin()).await;
    if let Some(store) = idem_tests::mysql_store().await {
        let pool = store.pool().clone();
        in_a_transaction("mysql", &store, || pool.begin()).await;
    }
}

async fn in_a_transaction<S, DB, B, Fut>(name: &str, store: &S, begin: B)
where
    S: idem_runtime::store::Transactional<Connection = DB::Connection>,
    DB: sqlx::Database,
    B: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<sqlx::Transaction<'static, DB>, sqlx::Error>>,
{
    let op = Operation::new(namespace("steps_transaction"));
    let key = op.key(&"order-7").unwrap();
    let charge = Effect::default();
    let keys = Arc::new(std::sync::Mutex::new(Vec::new()));
    for fail in [true, false] {
        let mut tx = begin().await.unwrap();
        let (charge, keys) = (charge.clone(), keys.clone());
        let outcome = op
            .run_in_transaction(store, &mut *tx, &key, None, async move |_tx| {
                let paid = step("charge", async {
                    let attempt = attempt().expect("a step's own attempt");
                    keys.lock().unwrap().push(*attempt.key());
                    charge.run("charge").await
                })
                .await?;
                if fail {
                    return Err(Error::store("the order insert failed"));
                }
                Ok::<_, Error>(paid)
            })
            .await;
        if fail {
            assert!(outcome.is_err(), "{name}");
            tx.rollback().await.unwrap();
        } else {
            assert_eq!(
                outcome.unwrap(),
                Outcome::Executed("charge:2".to_string()),
                "{name}: the rolled-back attempt's run is not replayed"
            );
            tx.commit().await.unwrap();
        }
    }
    let keys = keys.lock().unwrap();
    assert_eq!(keys.len(), 2, "{name}");
    assert_eq!(
        keys[0], keys[1],
        "{name}: one downstream key on every attempt"
    );
    assert_ne!(keys[0], key, "{name}: the step's key, not the call's");
}

/// Removing a call's record (`Store::remove`) resets the call with its steps: the body
/// and every step run again.
#[tokio::test]
async fn removing_a_calls_record_resets_its_steps_too() {
    use idem_runtime::Store;

    let store = MemoryStore::new();
    let op = Operation::new(namespace("steps_remove"));
    let key = op.key(&"order-7").unwrap();
    let (charge, body) = (Effect::default(), Effect::default());
    let call = || {
        let (charge, body) = (charge.clone(), body.clone());
        async move {
            let run = body.run("body").await?;
            let paid = step("charge", charge.run("charge")).await?;
            Ok::<_, Error>(format!("{run} {paid}"))
        }
    };
    let first = op.run(&store, &key, None, call()).await.unwrap();
    assert_eq!(first, Outcome::Executed("body:1 charge:1".to_string()));
    assert!(
        store.remove(&key).await.unwrap(),
        "the call's record is removed"
    );
    let again = op.run(&store, &key, None, call()).await.unwrap();
    assert_eq!(
        again,
        Outcome::Executed("body:2 charge:2".to_string()),
        "the body and its step ran again"
    );
    assert_eq!((body.runs(), charge.runs()), (2, 2));
}
