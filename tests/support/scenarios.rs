//! Scenarios across processes that every shared backend must pass, generic over the store:
//! the backend suites (`redis.rs`, `postgres.rs`) run the same code.

use std::sync::Arc;
use std::time::Duration;

use idem_runtime::{Error, InFlight, Key, Operation, Outcome, Store};
use tokio::time::Instant;

use crate::{Probe, Runs};

/// A namespace of its own for each run, so that runs never see each other's records.
pub fn namespace(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("scenario.{test}.{nanos}")
}

/// `stores` (processes, in effect: each with its own connections and registry),
/// `callers` on each spread over `keys` keys: every key's body runs exactly once, and every
/// caller gets its own key's value.
pub async fn stores_with_callers_on_keys_run_each_body_once<S: Store + Clone + 'static>(
    stores: Vec<S>,
    callers: u32,
    keys: u32,
) {
    let op = Operation::new(namespace("stores_callers_keys"));
    let runs: Arc<Vec<Runs>> = Arc::new((0..keys).map(|_| Runs::default()).collect());
    let mut calls = Vec::new();
    for store in &stores {
        for caller in 0..callers {
            let (store, op, runs) = (store.clone(), op.clone(), Arc::clone(&runs));
            let n = caller % keys;
            calls.push(tokio::spawn(async move {
                let key = op.key(&n).unwrap();
                let value = op
                    .run(&store, &key, None, async {
                        runs[n as usize].hit();
                        Ok::<_, Error>(n)
                    })
                    .await
                    .unwrap()
                    .into_inner();
                (n, value)
            }));
        }
    }
    for call in calls {
        let (n, value) = call.await.unwrap();
        assert_eq!(value, n, "a caller got another key's value");
    }
    let ran: Vec<usize> = runs.iter().map(Runs::count).collect();
    assert_eq!(ran, vec![1; keys as usize], "each key's body ran once");
}

/// Two stores on separate connections (two processes, in effect), 200 concurrent callers
/// each on one key: the body runs once and all 400 get its value.
pub async fn two_stores_200_callers_each<S: Store + Clone>(first: S, second: S) {
    let op = Arc::new(Operation::new(namespace("two_stores")));
    let key = op.key(&"order-1").unwrap();
    let runs = Runs::default();
    let mut calls = Vec::new();
    for store in [first, second] {
        for i in 0..200_u32 {
            let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
            calls.push(tokio::spawn(async move {
                op.run(&store, &key, None, async move {
                    runs.hit();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok::<_, Error>(format!("receipt-{i}"))
                })
                .await
            }));
        }
    }
    let mut values = Vec::new();
    for call in calls {
        values.push(call.await.unwrap().unwrap().into_inner());
    }
    assert_eq!(runs.count(), 1, "one body for 400 callers on two stores");
    assert_eq!(values.len(), 400);
    assert!(
        values.iter().all(|v| *v == values[0]),
        "all 400 got the same value"
    );
}

/// A holder that stopped renewing (paused past its lease) is taken over; its own
/// completion is refused, its caller told `Unrecorded`, and the new owner's result stands.
pub async fn zombie_cannot_overwrite_the_new_owner<S: Store + Clone>(store: S) {
    let lease = Duration::from_millis(200);
    let op = Operation::new(namespace("zombie")).lease(lease);
    let key = op.key(&1).unwrap();
    let (claimed, has_claimed) = tokio::sync::oneshot::channel();
    let (owner_done, wake_zombie) = tokio::sync::oneshot::channel::<()>();
    let zombie = {
        let (op, store) = (op.clone(), Probe::frozen(store.clone()));
        tokio::spawn(async move {
            op.run(&store, &key, None, async {
                let _ = claimed.send(());
                // Paused until another process owns the key and recorded its result.
                let _ = wake_zombie.await;
                Ok::<_, Error>("zombie".to_string())
            })
            .await
        })
    };
    has_claimed.await.unwrap();
    // The zombie never renews: a lease after its claim, the store lets the key go.
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let other_process = Probe::frozen(store.clone());
    let owner = op.run(&other_process, &key, None, async {
        Ok::<_, Error>("owner".to_string())
    });
    assert_eq!(owner.await.unwrap(), Outcome::Executed("owner".to_string()));
    owner_done.send(()).unwrap();
    // The zombie's body did run, but its result is not the key's: its caller is told so
    // (`Unrecorded`, never a replay that would say its body did not run), and every later
    // caller gets the owner's record.
    let err = zombie.await.unwrap().unwrap_err();
    assert!(matches!(err, Error::Unrecorded(_)), "{err}");
    let replay = op.run(&store, &key, None, async {
        Ok::<_, Error>("third".to_string())
    });
    assert_eq!(
        replay.await.unwrap(),
        Outcome::Replayed("owner".to_string())
    );
}

/// Waits until the claim on `key` has lapsed in `store`: its holder never renews.
async fn lapsed<S: Store>(store: &S, key: &Key) {
    while store.lease_left(key).await.unwrap().is_some() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A holder paused past its lease whose body then returns: it never answers a result
/// that is not the key's. If nobody took the key, its result is recorded and answered;
/// if another holder runs the key, it gets `Unrecorded`, whose source is `InProgress` (and
/// the retry replays the other holder's record). The case where another holder recorded
/// first is [`zombie_cannot_overwrite_the_new_owner`].
pub async fn a_lapsed_holder_answers_only_what_the_key_records<S: Store + Clone>(store: S) {
    let lease = Duration::from_millis(200);
    let op = Operation::new(namespace("lapsed-holder")).lease(lease);
    let frozen = Probe::frozen(store.clone());
    let paused_past_its_lease = |key: Key, value: &'static str| {
        let (op, frozen) = (op.clone(), frozen.clone());
        let (claimed, has_claimed) = tokio::sync::oneshot::channel();
        let (wake, woken) = tokio::sync::oneshot::channel::<()>();
        let call = tokio::spawn(async move {
            op.run(&frozen, &key, None, async {
                let _ = claimed.send(());
                let _ = woken.await;
                Ok::<_, Error>(value.to_string())
            })
            .await
        });
        (call, has_claimed, wake)
    };

    // Nobody took the key: the late result is recorded, and replayed after.
    let key = op.key(&(1, std::process::id())).unwrap();
    let (call, claimed, wake) = paused_past_its_lease(key, "late");
    claimed.await.unwrap();
    lapsed(&store, &key).await;
    wake.send(()).unwrap();
    assert_eq!(
        call.await.unwrap().unwrap(),
        Outcome::Executed("late".to_string())
    );
    let replay = op.run(&store, &key, None, async {
        Ok::<_, Error>("again".to_string())
    });
    assert_eq!(replay.await.unwrap(), Outcome::Replayed("late".to_string()));

    // Another holder runs the key: `Unrecorded` (the body ran; its result is not recorded),
    // never the late value as if recorded, nor an error that says the body did not run.
    let key = op.key(&(2, std::process::id())).unwrap();
    let (call, claimed, wake) = paused_past_its_lease(key, "late");
    claimed.await.unwrap();
    lapsed(&store, &key).await;
    let (owner, owner_claimed, finish_owner) = {
        let op = op.clone().lease(Duration::from_secs(30));
        let other_process = Probe::frozen(store.clone());
        let (claimed, has_claimed) = tokio::sync::oneshot::channel();
        let (finish, finished) = tokio::sync::oneshot::channel::<()>();
        let call = tokio::spawn(async move {
            op.run(&other_process, &key, None, async {
                let _ = claimed.send(());
                let _ = finished.await;
                Ok::<_, Error>("owner".to_string())
            })
            .await
        });
        (call, has_claimed, finish)
    };
    owner_claimed.await.unwrap();
    wake.send(()).unwrap();
    let err = call.await.unwrap().unwrap_err();
    let Error::Unrecorded(why) = &err else {
        panic!("a body that ran is answered {err}, not Unrecorded");
    };
    assert!(
        matches!(why.downcast_ref::<Error>(), Some(Error::InProgress)),
        "{err}"
    );
    finish_owner.send(()).unwrap();
    assert_eq!(
        owner.await.unwrap().unwrap(),
        Outcome::Executed("owner".to_string())
    );
    let replay = op.run(&store, &key, None, async {
        Ok::<_, Error>("again".to_string())
    });
    assert_eq!(
        replay.await.unwrap(),
        Outcome::Replayed("owner".to_string())
    );
}

/// A downstream resource fenced by tokens: a write lands only with a token larger than
/// the last one that landed.
#[derive(Default)]
struct Fenced(std::sync::Mutex<(u64, &'static str)>);

impl Fenced {
    fn write(&self, token: idem_runtime::Token, note: &'static str) -> bool {
        let mut last = self.0.lock().unwrap();
        if token.get() <= last.0 {
            return false;
        }
        *last = (token.get(), note);
        true
    }
}

/// Two holders of one key, the first paused past its lease: the fencing token each gets
/// from `attempt().token()` lets the newer holder's downstream write land and refuses the
/// zombie's, whether the zombie took its token before it was taken over or asks after.
pub async fn zombie_fences_are_refused_downstream<S: Store + Clone>(store: S) {
    let lease = Duration::from_millis(300);
    let op = Operation::new(namespace("zombie-fence")).lease(lease);
    let downstream = Arc::new(Fenced::default());
    for asks_late in [false, true] {
        let key = op.key(&asks_late).unwrap();
        let (claimed, has_claimed) = tokio::sync::oneshot::channel();
        let (taken_over, resume) = tokio::sync::oneshot::channel::<()>();
        // What the zombie's fenced write did: its answer is the owner's record.
        let (wrote, zombie_wrote) = tokio::sync::oneshot::channel();
        let zombie = {
            let (op, store, downstream) =
                (op.clone(), Probe::frozen(store.clone()), downstream.clone());
            tokio::spawn(async move {
                op.run(&store, &key, None, async move {
                    let attempt = idem_runtime::attempt().expect("inside the body");
                    let early = if asks_late {
                        None
                    } else {
                        Some(attempt.token().await?)
                    };
                    let _ = claimed.send(early);
                    let _ = resume.await;
                    // Asked again, or for the first time, after the takeover. `None`:
                    // a store that checks the claim refused to fence a lost one.
                    let token = match attempt.token().await {
                        Ok(token) => Some(token),
                        Err(Error::Store(_)) if asks_late => None,
                        Err(err) => return Err(err),
                    };
                    if let (Some(early), Some(token)) = (early, token) {
                        assert_eq!(early, token, "one claim, one fence");
                    }
                    let _ = wrote.send(token.map(|token| downstream.write(token, "zombie")));
                    Ok::<_, Error>((0, false))
                })
                .await
            })
        };
        let early = has_claimed.await.unwrap();
        // Another process waits out the zombie's lease, takes the key over and writes.
        let owner = op
            .clone()
            .wait(Duration::from_secs(20))
            .run(&Probe::frozen(store.clone()), &key, None, async {
                let token = idem_runtime::attempt().unwrap().token().await?;
                Ok::<_, Error>((token.get(), downstream.write(token, "owner")))
            })
            .await
            .unwrap();
        let Outcome::Executed((owner_token, landed)) = owner else {
            panic!("the owner must run its body: {owner:?}");
        };
        assert!(landed, "the owner's fenced write lands");
        if let Some(early) = early {
            assert!(owner_token > early.get(), "{owner_token} after {early:?}");
        }
        taken_over.send(()).unwrap();
        assert_ne!(
            zombie_wrote.await.unwrap(),
            Some(true),
            "the zombie's fenced write must be refused"
        );
        // Its body ran (its effect was fenced): it is told so, never answered a replay.
        let err = zombie.await.unwrap().unwrap_err();
        assert!(
            matches!(err, Error::Unrecorded(_)),
            "the zombie is told Unrecorded: {err}"
        );
        assert_eq!(downstream.0.lock().unwrap().1, "owner");
    }
}

/// The child of [`a_crashed_holder_frees_its_key_within_seconds`]: claims the key with
/// the default lease, prints `claimed`, renews (printing `renewed` each time) and hangs
/// until it is killed.
pub async fn default_lease_crash_child<S: Store + Clone>(store: S) {
    let namespace = std::env::var(CRASH_NAMESPACE).expect("run by the crash test");
    let op = Operation::new(namespace);
    let key = op.key(&"crash").unwrap();
    let _ = op
        .run(&Probe::announcing_renewals(store), &key, None, async {
            println!("claimed");
            std::future::pending::<()>().await;
            Ok::<_, Error>(0_u32)
        })
        .await;
}

/// What a user gets from the defaults after a crash: the test `child` of this test binary
/// claims a key with the default lease and renews it; it is SIGKILLed right after a
/// renewal (the worst moment: a whole lease left), and a retry of the key from this
/// process must run its body within 10 s of the kill. Returns how long that took.
pub async fn a_crashed_holder_frees_its_key_within_seconds<S: Store + Clone>(
    store: S,
    child: &str,
) -> Duration {
    let namespace = namespace("default_lease_crash");
    let mut process = crate::Child::start(child, &[(CRASH_NAMESPACE, &namespace)]);
    process.wait_for("claimed").await;
    process.wait_for("renewed").await;
    process.kill("");
    let killed = Instant::now();

    let op = Operation::new(namespace);
    let key = op.key(&"crash").unwrap();
    let rejected = op
        .clone()
        .in_flight(InFlight::Reject)
        .run(&store, &key, None, async { Ok::<_, Error>(1_u32) })
        .await;
    assert!(
        matches!(rejected, Err(Error::InProgress)),
        "the key is still held right after the kill: {rejected:?}"
    );
    // The retry waits as long as it must, so that a key stuck past 10 s shows as a
    // measured time, not as a timeout.
    let retried = op
        .wait(Duration::from_secs(60))
        .run(&store, &key, None, async { Ok::<_, Error>(2_u32) })
        .await
        .unwrap();
    let elapsed = killed.elapsed();
    assert_eq!(retried, Outcome::Executed(2));
    println!("a holder SIGKILLed right after a renewal: its key ran again {elapsed:?} later");
    assert!(
        elapsed <= Duration::from_secs(10),
        "the default lease must free a crashed holder's key within 10 s: {elapsed:?}"
    );
    elapsed
}

/// The environment variable that hands the crash test's namespace to its child.
pub const CRASH_NAMESPACE: &str = "IDEM_CRASH_NAMESPACE";
const CRASH_LEASE: Duration = Duration::from_secs(1);

/// The child of [`crash_frees_the_key_after_the_lease`]: claims the key with a 1 s lease
/// that it never renews, prints `claimed`, and hangs until it is killed.
pub async fn crash_child<S: Store + Clone>(store: S) {
    let namespace = std::env::var(CRASH_NAMESPACE).expect("run by the crash test");
    let op = Operation::new(namespace).lease(CRASH_LEASE);
    let key = op.key(&"crash").unwrap();
    let _ = op
        .run(&Probe::frozen(store), &key, None, async {
            println!("claimed");
            std::future::pending::<()>().await;
            Ok::<_, Error>(0_u32)
        })
        .await;
}

/// Runs the test `child` of this test binary as a process that claims a key, kills it with
/// SIGKILL, and checks that another process is refused before the lease ends and runs the
/// body after it.
pub async fn crash_frees_the_key_after_the_lease<S: Store + Clone>(store: S, child: &str) {
    let namespace = namespace("crash");
    let mut process = crate::Child::start(child, &[(CRASH_NAMESPACE, &namespace)]);
    process.wait_for("claimed").await;
    // The child claimed before it printed: its lease ends at most this long from here.
    let seen = Instant::now();
    process.kill("");

    let op = Operation::new(namespace).lease(CRASH_LEASE);
    let key = op.key(&"crash").unwrap();
    let refused = op
        .clone()
        .in_flight(InFlight::Reject)
        .run(&store, &key, None, async { Ok::<_, Error>(1_u32) })
        .await;
    // Refused while the lease lasts; a machine so busy that the lease ran out meanwhile
    // may have let this call take over, which is right too.
    match refused {
        Err(Error::InProgress) => {}
        Ok(Outcome::Executed(1)) if seen.elapsed() >= CRASH_LEASE => return,
        other => panic!("before the lease ended: {other:?}"),
    }

    // A waiting call polls until the lease runs out, then claims and runs. It waits far
    // longer than the lease if it must: a key stuck past its lease would make it fail.
    let out = op
        .wait(Duration::from_secs(20))
        .run(&store, &key, None, async { Ok::<_, Error>(2_u32) })
        .await
        .unwrap();
    assert_eq!(out, Outcome::Executed(2));
    println!(
        "the crashed holder's key ran again {:?} after it was seen claimed",
        seen.elapsed()
    );
}
