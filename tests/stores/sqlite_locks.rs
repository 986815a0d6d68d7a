//! `SqliteStore` when the file's write lock is scarce: a writer that holds it for seconds,
//! and a crowd of claims from several pools. The store's timeout bounds the wait for the
//! lock; a writer that holds it past the leases does not hand live holders' keys away; a
//! crowd never takes a key from a live holder, and every caller of a key gets one value.

use idem_runtime::ClaimRequest;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::{Claim, Error, Operation, Outcome, SqliteStore, Store};
use idem_tests::scenarios::namespace;
use idem_tests::Runs;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use sqlx::Connection;

/// A fresh file of its own for `test`, in memory (`/dev/shm`) where there is one: these tests are
/// about the file's lock, and a disk that another process keeps busy (a build's gigabytes
/// being written back, as at the start of CI's test run) stalls a commit's fsync for longer
/// than the stores' timeouts, which then answer `Unrecorded`, rightly.
fn fresh_file(test: &str) -> PathBuf {
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
    };
    let path = dir.join(format!(
        "idem-sqlite-locks-{test}-{}.db",
        std::process::id()
    ));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    path
}

async fn open(path: &Path) -> SqliteStore {
    let store = SqliteStore::open(path).await.unwrap();
    store.migrate().await.unwrap();
    store
}

/// Another writer on the file, as another process would be: it takes the write lock
/// (`BEGIN IMMEDIATE`) and keeps it until told.
async fn lock_the_file(path: &Path) -> SqliteConnection {
    let mut writer = SqliteConnection::connect_with(&SqliteConnectOptions::new().filename(path))
        .await
        .unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut writer)
        .await
        .unwrap();
    writer
}

async fn unlock(mut writer: SqliteConnection) {
    sqlx::query("COMMIT").execute(&mut writer).await.unwrap();
}

/// A holder in a process of its own: `op` on `store` runs `key`'s body, which waits until
/// the returned sender says to finish (its lease renewed meanwhile), then answers `holder`.
/// Returns once the body runs.
async fn hold(
    op: &Operation,
    store: SqliteStore,
    key: idem_runtime::Key,
) -> (
    tokio::task::JoinHandle<Result<Outcome<String>, Error>>,
    tokio::sync::oneshot::Sender<()>,
) {
    let (started, body_started) = tokio::sync::oneshot::channel();
    let (finish, finished) = tokio::sync::oneshot::channel::<()>();
    let op = op.clone();
    let holder = tokio::spawn(async move {
        op.run(&store, &key, None, async {
            let _ = started.send(());
            let _ = finished.await;
            Ok::<_, Error>("holder".to_string())
        })
        .await
    });
    body_started.await.unwrap();
    (holder, finish)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_timeout_bounds_the_wait_for_the_write_lock() {
    let path = fresh_file("timeout");
    let store = open(&path).await.with_timeout(Duration::from_secs(20));
    let op = Operation::new(namespace("sqlite.lock-timeout"));

    // Another writer holds the lock for 5 s, past SQLite's busy timeout of 3 s that the
    // connections were opened with: the claim waits, within its own 20 s.
    let writer = lock_the_file(&path).await;
    let key = op.key(&1).unwrap();
    let claim = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .claim(&ClaimRequest::new(&key, Duration::from_secs(5)))
                .await
        })
    };
    tokio::time::sleep(Duration::from_secs(5)).await; // how long the other writer writes
    assert!(
        !claim.is_finished(),
        "the claim gave up before its timeout: {:?}",
        claim.await
    );
    unlock(writer).await;
    assert!(matches!(
        claim.await.unwrap().unwrap(),
        Claim::Acquired { .. }
    ));

    // A shorter timeout fails closed while the lock is still held.
    let writer = lock_the_file(&path).await;
    let short = store.clone().with_timeout(Duration::from_millis(500));
    let key = op.key(&2).unwrap();
    let failed = short
        .claim(&ClaimRequest::new(&key, Duration::from_secs(5)))
        .await;
    assert!(matches!(failed, Err(Error::Store(_))), "{failed:?}");
    unlock(writer).await;
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&key, Duration::from_secs(5)))
            .await
            .unwrap(),
        Claim::Acquired { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_holding_the_lock_past_the_lease_does_not_lapse_a_live_holder() {
    // Two stores on one file are two processes: their own pools, no shared registry.
    let path = fresh_file("frozen-writer");
    let holder_store = open(&path).await.with_timeout(Duration::from_secs(20));
    let duplicate_store = open(&path).await.with_timeout(Duration::from_secs(20));
    let lease = Duration::from_secs(1);
    let op = Operation::new(namespace("sqlite.frozen-writer"))
        .lease(lease)
        .wait(Duration::from_secs(60));
    let key = op.key(&1).unwrap();

    let (holder, finish) = hold(&op, holder_store, key).await;

    // A writer takes the file's lock and keeps it for three leases (a process paused
    // while it writes); meanwhile a duplicate comes, waits for the holder, then for the lock.
    let writer = lock_the_file(&path).await;
    let runs = Runs::default();
    let duplicate = {
        let (op, store, runs) = (op.clone(), duplicate_store.clone(), runs.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async move {
                runs.hit();
                Ok::<_, Error>("duplicate".to_string())
            })
            .await
        })
    };
    tokio::time::sleep(lease * 3).await; // how long the writer holds the lock
    unlock(writer).await;

    // The holder's lease ran out while nobody could write: it is still the holder's.
    tokio::time::sleep(lease * 2).await; // the duplicate has its chance to take over
    finish.send(()).unwrap();
    assert_eq!(
        holder.await.unwrap().unwrap(),
        Outcome::Executed("holder".to_string())
    );
    assert_eq!(
        duplicate.await.unwrap().unwrap(),
        Outcome::Replayed("holder".to_string())
    );
    assert_eq!(runs.count(), 0, "the duplicate's body never ran");
}

/// The store-level core of the test above, without a holder's renewals racing the claim
/// for the lock: a claim that waited out a lease for the file's lock finds the lapsed claim
/// it came for given its time back (a lease from the moment the lock came free), not taken.
/// A lone claim commits by itself only when it got the lock before such a wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_waited_out_a_lease_for_the_lock_gives_the_time_back() {
    let path = fresh_file("time-back");
    let holder = open(&path).await.with_timeout(Duration::from_secs(20));
    let duplicate = open(&path).await.with_timeout(Duration::from_secs(20));
    let lease = Duration::from_secs(1);
    let key = Operation::new(namespace("sqlite.time-back"))
        .key(&1)
        .unwrap();
    let Claim::Acquired { token, .. } =
        holder.claim(&ClaimRequest::new(&key, lease)).await.unwrap()
    else {
        panic!("a fresh key is free");
    };

    // The file locked (a process paused while it writes) until the claim lapsed, which
    // nobody can write about meanwhile; then a duplicate comes and waits for the lock.
    let writer = lock_the_file(&path).await;
    idem_tests::until_lapsed(&holder, &key).await;
    let (started, claiming) = tokio::sync::oneshot::channel();
    let claim = tokio::spawn(async move {
        let _ = started.send(());
        duplicate.claim(&ClaimRequest::new(&key, lease)).await
    });
    claiming.await.unwrap();
    tokio::time::sleep(lease * 2).await; // how much longer the writer holds the lock
    assert!(!claim.is_finished(), "the claim waits for the lock");
    unlock(writer).await;

    assert_eq!(
        claim.await.unwrap().unwrap(),
        Claim::InProgress { fingerprint: None },
        "the lapsed claim was given its time back, not taken over"
    );
    assert!(
        holder.renew(&key, token, lease).await.unwrap(),
        "its holder renews"
    );
}

/// The lockout another process saw counts too: a duplicate that comes once the file is free
/// again, having waited for nothing itself, finds the lapsed claim given its time back,
/// because the holder's process noted beside the file that its renewals had been waiting
/// for the lock since before the lease ran out. Here the holder's renewals give up at its
/// timeout, so that the duplicate is the only writer when the lock comes free: without the
/// note, it would take the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_after_a_freeze_sees_the_holders_wait_and_takes_nothing() {
    let path = fresh_file("noted");
    let holder = open(&path).await.with_timeout(Duration::from_millis(300));
    let duplicate = open(&path).await.with_timeout(Duration::from_secs(20));
    let lease = Duration::from_secs(2);
    let key = Operation::new(namespace("sqlite.noted")).key(&1).unwrap();
    let Claim::Acquired { token, .. } =
        holder.claim(&ClaimRequest::new(&key, lease)).await.unwrap()
    else {
        panic!("a fresh key is free");
    };

    let writer = lock_the_file(&path).await;
    let renewal = holder.renew(&key, token, lease).await;
    assert!(matches!(renewal, Err(Error::Store(_))), "{renewal:?}");
    idem_tests::until_lapsed(&duplicate, &key).await;
    let renewal = holder.renew(&key, token, lease).await; // its next renewal, kept out too
    assert!(matches!(renewal, Err(Error::Store(_))), "{renewal:?}");
    unlock(writer).await;

    assert_eq!(
        duplicate
            .claim(&ClaimRequest::new(&key, lease))
            .await
            .unwrap(),
        Claim::InProgress { fingerprint: None },
        "the lapsed claim was given its time back, not taken over"
    );
    assert!(
        holder.renew(&key, token, lease).await.unwrap(),
        "its holder renews"
    );
}

/// The same with a live holder, as it runs: a writer frozen past the lease, and a duplicate
/// in another process that comes only as the file comes free, racing the holder's waiting
/// renewal for the lock. Whoever wins, the duplicate's body does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_that_comes_as_a_long_freeze_ends_takes_nothing_from_a_live_holder() {
    let path = fresh_file("late");
    let holder_store = open(&path).await.with_timeout(Duration::from_secs(20));
    let duplicate_store = open(&path).await;
    let lease = Duration::from_secs(1);
    let op = Operation::new(namespace("sqlite.late")).lease(lease);
    let runs = Runs::default();
    for n in 0..3 {
        let key = op.key(&n).unwrap();
        let (holder, finish) = hold(&op, holder_store.clone(), key).await;
        let writer = lock_the_file(&path).await;
        idem_tests::until_lapsed(&duplicate_store, &key).await;
        unlock(writer).await;
        let answered = op
            .clone()
            .in_flight(idem_runtime::InFlight::Reject)
            .run(&duplicate_store, &key, None, async {
                runs.hit();
                Ok::<_, Error>("duplicate".to_string())
            })
            .await;
        assert!(matches!(answered, Err(Error::InProgress)), "{answered:?}");
        finish.send(()).unwrap();
        assert_eq!(
            holder.await.unwrap().unwrap(),
            Outcome::Executed("holder".to_string())
        );
    }
    assert_eq!(runs.count(), 0, "no duplicate's body ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_on_one_file_never_takes_a_key_from_a_live_holder() {
    // 4 pools (processes) × 64 callers, each key called once from every pool, every body
    // outlasting its 1 s lease: the holders' renewals compete with the crowd's claims and
    // completions for the file's lock.
    const POOLS: usize = 4;
    const CALLERS: usize = 64;
    let path = fresh_file("crowd");
    let mut stores = Vec::new();
    for _ in 0..POOLS {
        stores.push(open(&path).await.with_timeout(Duration::from_secs(30)));
    }
    let lease = Duration::from_secs(1);
    let op = Operation::new(namespace("sqlite.crowd"))
        .lease(lease)
        .wait(Duration::from_secs(120));
    let bodies: Arc<Mutex<HashMap<usize, usize>>> = Arc::default();
    let start = Arc::new(tokio::sync::Barrier::new(POOLS * CALLERS));
    let mut calls = Vec::new();
    for (pool, store) in stores.iter().enumerate() {
        for caller in 0..CALLERS {
            let (op, store, bodies, start) =
                (op.clone(), store.clone(), bodies.clone(), start.clone());
            calls.push(tokio::spawn(async move {
                let key = op.key(&caller).unwrap();
                start.wait().await;
                let outcome = op
                    .run(&store, &key, None, async move {
                        *bodies.lock().unwrap().entry(caller).or_default() += 1;
                        tokio::time::sleep(lease + lease / 2).await; // the body's work
                        Ok::<_, Error>(pool)
                    })
                    .await;
                (caller, outcome)
            }));
        }
    }
    let mut answers: HashMap<usize, Vec<usize>> = HashMap::new();
    for call in calls {
        let (caller, outcome) = call.await.unwrap();
        let value = outcome
            .unwrap_or_else(|err| panic!("caller {caller}: {err}"))
            .into_inner();
        answers.entry(caller).or_default().push(value);
    }
    let bodies = bodies.lock().unwrap().clone();
    for caller in 0..CALLERS {
        assert_eq!(bodies[&caller], 1, "key {caller}: one body");
        let values = &answers[&caller];
        assert!(
            values.iter().all(|value| *value == values[0]),
            "key {caller}: every caller gets one value, got {values:?}"
        );
        let recorded = op
            .run(&stores[0], &op.key(&caller).unwrap(), None, async {
                Ok::<_, Error>(usize::MAX)
            })
            .await
            .unwrap();
        assert_eq!(recorded, Outcome::Replayed(values[0]), "key {caller}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_and_completions_go_through_while_the_application_holds_every_connection() {
    let path = fresh_file("holders");
    let store = open(&path).await.with_timeout(Duration::from_secs(2));
    let op = Operation::new(namespace("sqlite.holders"));
    let key = op.key(&1).unwrap();
    let Claim::Acquired { token, .. } = store
        .claim(&ClaimRequest::new(&key, Duration::from_secs(5)))
        .await
        .unwrap()
    else {
        panic!("a fresh key is free");
    };
    // The application takes every pooled connection and keeps them.
    let mut held = Vec::new();
    while let Some(conn) = store.pool().try_acquire() {
        held.push(conn);
    }
    while (held.len() as u32) < idem_runtime::store::sqlite::DEFAULT_CONNECTIONS {
        held.push(store.pool().acquire().await.unwrap());
    }
    // The holder's own statements do not wait for them.
    assert!(store
        .renew(&key, token, Duration::from_secs(5))
        .await
        .unwrap());
    assert!(store
        .complete(
            &key,
            token,
            idem_runtime::Bytes::from_static(b"1"),
            Duration::from_secs(60)
        )
        .await
        .unwrap());
    // A claim does: it fails closed within the store's timeout.
    let other = op.key(&2).unwrap();
    let crowded = store
        .claim(&ClaimRequest::new(&other, Duration::from_secs(5)))
        .await;
    assert!(matches!(crowded, Err(Error::Store(_))), "{crowded:?}");
    drop(held);
}

/// A call whose claim cannot get the write lock fails closed within the store's timeout,
/// once, however often its claim is sent: the lock is held until the call has answered, so
/// a call that outwaited it would never answer at all, and one that sent its claim three
/// times on a timeout each would take three timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_fails_closed_within_its_timeout_while_another_writer_holds_the_lock() {
    let path = fresh_file("call-timeout");
    let timeout = Duration::from_secs(2);
    let store = open(&path).await.with_timeout(timeout);
    let op = Operation::new(namespace("sqlite.call-timeout"));
    let writer = lock_the_file(&path).await;
    let runs = Runs::default();
    let key = op.key(&1).unwrap();
    let started = std::time::Instant::now();
    let ran = op
        .run(&store, &key, None, async {
            runs.hit();
            Ok::<_, Error>(1)
        })
        .await;
    let took = started.elapsed();
    assert!(matches!(ran, Err(Error::Store(_))), "{ran:?}");
    assert_eq!(runs.count(), 0);
    // A whole timeout of slack for a busy machine; three tries would take three timeouts.
    assert!(
        took < timeout * 2,
        "the call took {took:?}, its timeout is {timeout:?}"
    );
    unlock(writer).await;
    assert_eq!(
        op.run(&store, &key, None, async { Ok::<_, Error>(2) })
            .await
            .unwrap(),
        Outcome::Executed(2)
    );
}

/// Another process that hogs the file's write lock: it holds it for `hold`, lets go for
/// 20 ms, and takes it again, until the test drops the guard. SQLite's own busy handler,
/// which sleeps up to 100 ms between looks, can sleep through such a gap.
struct Hog(tokio::task::JoinHandle<()>);

impl Hog {
    fn start(path: &Path, hold: Duration) -> Self {
        let path = path.to_path_buf();
        Self(tokio::spawn(async move {
            loop {
                let writer = lock_the_file(&path).await;
                tokio::time::sleep(hold).await;
                unlock(writer).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }))
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A dead holder's key frees within two leases whatever the write lock does: with another
/// process holding the lock for 2.5 s of every 2.52 s at an 8 s lease (here scaled to a
/// 2 s lease), every claimer waits long for it, and each wait used to give the dead claim
/// a new lease. Time is given back once now, until its holder renews, which a dead one
/// never does, and only the time the file could not be written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holders_key_frees_within_two_leases_beside_a_process_hogging_the_lock() {
    let path = fresh_file("hog");
    let dead = open(&path).await.with_timeout(Duration::from_secs(20));
    let claimer = open(&path).await.with_timeout(Duration::from_secs(20));
    // 2 s here; `IDEM_SQLITE_HOG_LEASE_MS=8000` runs it at the default lease.
    let lease = Duration::from_millis(
        std::env::var("IDEM_SQLITE_HOG_LEASE_MS")
            .ok()
            .and_then(|ms| ms.parse().ok())
            .unwrap_or(2000),
    );
    let key = Operation::new(namespace("sqlite.hog")).key(&1).unwrap();
    let claimed = std::time::Instant::now();
    // A holder that never renews: a process SIGKILLed after its claim.
    assert!(matches!(
        dead.claim(&ClaimRequest::new(&key, lease)).await.unwrap(),
        Claim::Acquired { .. }
    ));
    // The hog's first turn begins a little after the claim, so that the lease runs out
    // just after one of its gaps and the claimer waits most of a turn for the lock: long
    // enough that it gives the dead claim that time back, once.
    tokio::time::sleep(lease * 3 / 10).await;
    let hog = Hog::start(&path, lease * 5 / 16);
    // The crowd's claims, as fast as they answer, until one takes the key.
    let taken = loop {
        match claimer
            .claim(&ClaimRequest::new(&key, lease))
            .await
            .unwrap()
        {
            Claim::Acquired { .. } => break claimed.elapsed(),
            other => {
                eprintln!("T {} {other:?}", claimed.elapsed().as_millis());
                tokio::task::yield_now().await
            }
        }
        assert!(
            claimed.elapsed() < lease * 15,
            "the dead holder's key is still held after 15 leases"
        );
    };
    drop(hog);
    println!("a dead holder's key taken {taken:?} after its claim (lease {lease:?}), beside a hog");
    // The lease, the wait for one turn given back, and the wait for the next turn: within
    // two leases; and one more lease for the gaps a busy machine can miss. Each wait given
    // back again, or a lease given back from the end of a wait, would add a lease.
    assert!(taken < lease * 3, "taken after {taken:?}, lease {lease:?}");
}

/// A writer frozen for longer than a lease takes no key from a live holder, even when the
/// duplicate that finds the lease run out only began waiting for the lock late in the
/// freeze and whose tries give up at its timeout: the dark time runs over its failed tries,
/// and the holder's renewal, which waited for the lock too, lands in the time given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freeze_longer_than_the_lease_takes_no_key_from_a_live_holder() {
    let path = fresh_file("freeze");
    let holder_store = open(&path).await.with_timeout(Duration::from_secs(20));
    let duplicate_store = open(&path).await.with_timeout(Duration::from_millis(500));
    let lease = Duration::from_secs(1);
    let op = Operation::new(namespace("sqlite.freeze")).lease(lease);
    let key = op.key(&1).unwrap();
    let (holder, finish) = hold(&op, holder_store, key).await;

    // The file frozen for four leases; a duplicate tries again and again meanwhile, each
    // try giving up after half a second.
    let writer = lock_the_file(&path).await;
    idem_tests::until_lapsed(&duplicate_store, &key).await;
    let runs = Runs::default();
    let duplicate = {
        let (op, store, runs) = (op.clone(), duplicate_store.clone(), runs.clone());
        tokio::spawn(async move {
            loop {
                let ran = op
                    .clone()
                    .in_flight(idem_runtime::InFlight::Reject)
                    .run(&store, &key, None, async {
                        runs.hit();
                        Ok::<_, Error>("duplicate".to_string())
                    })
                    .await;
                match ran {
                    Err(Error::Store(_)) => {} // the lock: try again
                    other => return other,
                }
            }
        })
    };
    tokio::time::sleep(lease * 4).await; // how long the writer holds the lock
    unlock(writer).await;
    let answered = duplicate.await.unwrap();
    assert!(matches!(answered, Err(Error::InProgress)), "{answered:?}");
    finish.send(()).unwrap();
    assert_eq!(
        holder.await.unwrap().unwrap(),
        Outcome::Executed("holder".to_string())
    );
    assert_eq!(runs.count(), 0, "the duplicate's body never ran");
}
