//! Operating a store (`idem_runtime::admin`), on every store that implements it (memory,
//! PostgreSQL, MySQL/MariaDB, SQLite; `operations` and `paging` take any), against the real
//! servers: listing by namespace and state, paged; inspecting; a release refused
//! while the holder renews and done once it is silent; a forced release that fences the old
//! holder (its caller is told, and the value replayed afterwards is the new run's); a reset
//! that makes the next call run again. And `wait`: a duplicate beside a long lease gives up
//! when told.

use idem_runtime::ClaimRequest;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_runtime::admin::{Admin, Entry, Filter, Refusal, Release, State, Verdict};
use idem_runtime::store::Claimant;
use idem_runtime::{idempotent, Claim, Error, MemoryStore, Operation, Outcome, Store};
use idem_tests::scenarios::namespace;
use tokio::sync::oneshot;

/// A body that says it started, then waits for its signal, counting its runs.
async fn held_body(
    runs: Arc<AtomicUsize>,
    started: oneshot::Sender<()>,
    go: oneshot::Receiver<()>,
    value: u32,
) -> Result<u32, Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    let _ = started.send(());
    let _ = go.await;
    Ok(value)
}

/// Every entry `filter` selects, page after page until `next` is `None` (a store may end
/// a page short, even empty, with a `next`).
async fn listing<S: Admin>(store: &S, filter: &Filter) -> Vec<idem_runtime::admin::Entry> {
    let mut entries = Vec::new();
    let mut cursor = None;
    loop {
        let page = store.list(filter, cursor.as_ref()).await.unwrap();
        entries.extend(page.entries().iter().cloned());
        match page.next() {
            Some(next) => cursor = Some(next),
            None => return entries,
        }
    }
}

/// Every promise of the admin API, on one store.
async fn operations<S>(store: S, prefix: &str)
where
    S: Store + Admin + Clone,
{
    let op = Operation::new(format!("{prefix}.charge")).lease(Duration::from_secs(60));
    let other = Operation::new(format!("{prefix}.refund"));

    // Completed records list by namespace, with their size and no value unless asked.
    let done = op.key(&1_u32).unwrap();
    let _ = op
        .run(&store, &done, None, async { Ok::<_, Error>(41_u32) })
        .await
        .unwrap();
    let refund = other.key(&1_u32).unwrap();
    let _ = other
        .run(&store, &refund, None, async { Ok::<_, Error>(1_u32) })
        .await
        .unwrap();
    let page = listing(
        &store,
        &Filter::namespace(format!("{prefix}.charge")).completed(),
    )
    .await;
    assert_eq!(page.len(), 1, "{page:?}");
    let entry = &page[0];
    assert_eq!(entry.key(), &done);
    assert_eq!(entry.namespace(), Some(&*format!("{prefix}.charge")));
    assert_eq!(entry.state(), State::Completed);
    assert_eq!(
        entry.size(),
        Some(3),
        "the record of `41`: its tag and its JSON"
    );
    assert_eq!(entry.value(), None, "no value unless asked");
    assert_eq!(entry.label(), None, "no label unless the caller chose one");
    let inspected = store.inspect(&done).await.unwrap().unwrap();
    assert_eq!(inspected.value_json(), Some("41"));

    // A live holder: shown with its holder and token; a release is refused while it renews.
    let runs = Arc::new(AtomicUsize::new(0));
    let live = op.key(&2_u32).unwrap();
    let (go, wait) = oneshot::channel();
    let (started, has_started) = oneshot::channel();
    let first = tokio::spawn({
        let (store, op, runs) = (store.clone(), op.clone(), runs.clone());
        async move {
            let call = op.run(&store, &live, None, held_body(runs, started, wait, 1));
            idem_runtime::labelled("order 2", call).await
        }
    });
    has_started.await.unwrap();
    let held = store.inspect(&live).await.unwrap().unwrap();
    assert_eq!(held.state(), State::Held);
    assert_eq!(held.label(), Some("order 2"), "the label the caller chose");
    let holder = held.holder().expect("the holder is kept");
    assert_eq!(holder.pid(), std::process::id());
    assert_eq!(held.lease(), Some(Duration::from_secs(60)));
    assert!(!held.is_silent());
    let token = held.token().unwrap();
    let listed = listing(&store, &Filter::namespace(prefix).held()).await;
    assert_eq!(listed.iter().map(|e| *e.key()).collect::<Vec<_>>(), [live]);
    match Admin::release(&store, &live, token, Release::IfSilent)
        .await
        .unwrap()
    {
        Verdict::Refused(Refusal::Live { .. }) => {}
        other => panic!("a live holder's claim was not refused: {other:?}"),
    }
    let wrong = idem_runtime::Token::new(token.get() + 1_000);
    assert_eq!(
        Admin::release(&store, &live, wrong, Release::Force)
            .await
            .unwrap(),
        Verdict::Refused(Refusal::OtherToken(token))
    );
    assert!(matches!(
        store.reset(&live, Release::IfSilent).await.unwrap(),
        Verdict::Refused(Refusal::Live { .. })
    ));

    // Forced: the next call runs at once; the old holder's result is refused and its caller
    // told so; the value replayed afterwards is the new run's.
    assert_eq!(
        Admin::release(&store, &live, token, Release::Force)
            .await
            .unwrap(),
        Verdict::Done
    );
    // The holder's flight is landed with the release: a duplicate that will not wait at
    // all claims at once instead of being told `InProgress`.
    let second = op
        .clone()
        .wait(Duration::ZERO)
        .run(&store, &live, None, async { Ok::<_, Error>(2_u32) })
        .await
        .unwrap();
    assert_eq!(second, Outcome::Executed(2));
    go.send(()).unwrap();
    match first.await.unwrap() {
        Err(Error::Unrecorded(why)) => assert!(why.to_string().contains("by force"), "{why}"),
        other => panic!("the fenced holder's caller was answered {other:?}"),
    }
    let again = op
        .run(&store, &live, None, async { Ok::<_, Error>(3_u32) })
        .await
        .unwrap();
    assert_eq!(again, Outcome::Replayed(2));
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A dead holder (a claim no one renews): silent past half its lease, released, and the
    // retry runs at once.
    let dead = op.key(&3_u32).unwrap();
    let claimant = Claimant::new(op.namespace());
    // Long enough that the first look comes well within half of it, however loaded the
    // machine: silence is then waited for, never assumed.
    let lease = Duration::from_secs(4);
    let Claim::Acquired { token, .. } = store
        .claim(&ClaimRequest::new(&dead, lease).nonce(7).claimant(claimant))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    // Refused while it renewed within half its lease, then released once silent: the
    // store judges by its own clock, in the same write.
    assert!(!store.inspect(&dead).await.unwrap().unwrap().is_silent());
    loop {
        match Admin::release(&store, &dead, token, Release::IfSilent)
            .await
            .unwrap()
        {
            Verdict::Done => break,
            Verdict::Refused(Refusal::Live { .. }) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("a silent holder's claim was answered {other:?}"),
        }
    }
    assert!(
        released(store.inspect(&dead).await.unwrap()),
        "the released claim is gone, or lapsed for the next claim to take over knowingly"
    );
    let retried = op
        .run(&store, &dead, None, async { Ok::<_, Error>(9_u32) })
        .await
        .unwrap();
    assert_eq!(retried, Outcome::Executed(9));
    assert_eq!(
        Admin::release(&store, &dead, token, Release::Force)
            .await
            .unwrap(),
        Verdict::Refused(Refusal::NotHeld(State::Completed))
    );

    // Reset: forgotten, and the next call runs again.
    assert_eq!(
        store.reset(&done, Release::IfSilent).await.unwrap(),
        Verdict::Done
    );
    assert!(store.inspect(&done).await.unwrap().is_none());
    let rerun = op
        .run(&store, &done, None, async { Ok::<_, Error>(42_u32) })
        .await
        .unwrap();
    assert_eq!(rerun, Outcome::Executed(42));
    assert_eq!(
        store
            .reset(&op.key(&99_u32).unwrap(), Release::Force)
            .await
            .unwrap(),
        Verdict::Refused(Refusal::NotFound)
    );
}

/// 250 records, pages of 100: every key once, in key order, and a last page that says so.
async fn paging<S: Store + Admin + Clone>(store: S, prefix: &str) {
    let (_, pages) = paged(store, prefix).await;
    assert_eq!(pages, 3);
}

/// 250 records listed in pages of at most 100 until `next` is `None`: every key once, in
/// the store's order. The keys seen, in that order, and how many pages it took.
async fn paged<S: Store + Admin + Clone>(
    store: S,
    prefix: &str,
) -> (Vec<idem_runtime::Key>, usize) {
    let keys = recorded(&store, prefix, 250).await;
    listed(&store, prefix, 100, keys, Order::Keys).await
}

/// `n` completed calls in `<prefix>.paged`: their keys, sorted.
async fn recorded<S: Store + Clone>(store: &S, prefix: &str, n: u32) -> Vec<idem_runtime::Key> {
    let op = Operation::new(format!("{prefix}.paged"));
    let mut keys = Vec::new();
    for n in 0..n {
        let key = op.key(&n).unwrap();
        let _ = op
            .run(store, &key, None, async { Ok::<_, Error>(n) })
            .await
            .unwrap();
        keys.push(key);
    }
    keys.sort();
    keys
}

/// The order a store lists in, and what it promises of it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Order {
    /// In key order, each record once (memory, the SQL stores).
    Keys,
    /// In the store's own order, each record once (DynamoDB's `Scan`).
    Once,
    /// In `SCAN`'s order, each record at least once: a key may come twice while the server
    /// rehashes its keyspace (Redis; written by every other test on the shared server).
    AtLeastOnce,
}

/// `<prefix>.paged` listed in pages of at most `limit`: exactly `keys` (each once unless
/// `order` allows twice).
async fn listed<S: Admin>(
    store: &S,
    prefix: &str,
    limit: usize,
    keys: Vec<idem_runtime::Key>,
    order: Order,
) -> (Vec<idem_runtime::Key>, usize) {
    let filter = Filter::namespace(format!("{prefix}.paged")).limit(limit);
    let mut seen = Vec::new();
    let mut cursor = None;
    let mut pages = 0;
    loop {
        let page = store.list(&filter, cursor.as_ref()).await.unwrap();
        pages += 1;
        assert!(page.entries().len() <= limit);
        seen.extend(page.entries().iter().map(|e| *e.key()));
        match page.next() {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    let mut sorted = seen.clone();
    sorted.sort();
    if order == Order::AtLeastOnce {
        sorted.dedup();
    }
    assert_eq!(sorted, keys, "every key once");
    if order == Order::Keys {
        assert_eq!(seen, sorted, "in key order");
    }
    (seen, pages)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_is_operated_safely() {
    let store = MemoryStore::new();
    operations(store.clone(), &namespace("admin")).await;
    paging(store, &namespace("admin")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_is_operated_safely() {
    let Some(store) = idem_tests::postgres_store().await else {
        return;
    };
    operations(store.clone(), &namespace("admin.pg")).await;
    paging(store, &namespace("admin.pg")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_is_operated_safely() {
    let Some(store) = idem_tests::mysql_store().await else {
        return;
    };
    operations(store.clone(), &namespace("admin.mysql")).await;
    paging(store, &namespace("admin.mysql")).await;
}

/// The shared Redis, under a key prefix of this run's own: a listing walks only the
/// records of this test.
async fn redis_store(test: &str) -> Option<idem_runtime::RedisStore> {
    let store = idem_tests::redis_store().await?;
    Some(store.with_prefix(&format!("{}:", namespace(test))).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_is_operated_safely() {
    let Some(store) = redis_store("admin.redis").await else {
        return;
    };
    operations(store.clone(), &namespace("admin.redis")).await;
    // In SCAN's order, every key (at least once); at most 8 SCAN steps a page, so a page
    // may be short.
    let prefix = namespace("admin.redis");
    let keys = recorded(&store, &prefix, 250).await;
    let (_, pages) = listed(&store, &prefix, 100, keys.clone(), Order::AtLeastOnce).await;
    assert!(pages >= 3, "{pages} pages of at most 100 for 250 records");
    // Pages that end within a SCAN step: the next one starts there, skipping what was shown.
    let (_, pages) = listed(&store, &prefix, 7, keys, Order::AtLeastOnce).await;
    assert!(pages >= 36, "{pages} pages of at most 7 for 250 records");
}

/// DynamoDB (the emulator), where a holder's silence is watched, not compared: a release
/// `IfSilent` reads the item again after half a lease and releases only that version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_is_operated_safely() {
    let Some(store) = idem_tests::dynamodb_store().await else {
        return;
    };
    let prefix = namespace("admin.dynamodb");
    operations(store.clone(), &prefix).await;
    let keys = recorded(&store, &prefix, 250).await;
    listed(&store, &prefix, 100, keys.clone(), Order::Once).await;
    listed(&store, &prefix, 7, keys, Order::Once).await;
}

/// An operator in another process (another handle, with its own registry of running
/// calls) releases a live holder by force: the holder's completion is refused, it does not
/// claim the key again to record its result though no call took the key since, and its
/// caller is told `Unrecorded`; the next call runs. The store keeps the release for the
/// holder to find (Redis: a mark beside the record; DynamoDB: the released token; the SQL
/// stores: a trace row of its own).
async fn a_holder_elsewhere_records_nothing_after_a_forced_release<S>(
    holder: S,
    operator: S,
    prefix: &str,
) where
    S: Store + Admin + Clone + 'static,
{
    let op = Operation::new(format!("{prefix}.elsewhere")).lease(Duration::from_secs(60));
    let key = op.key(&1_u32).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let (started, has_started) = oneshot::channel();
    let (go, wait) = oneshot::channel();
    let first = tokio::spawn({
        let (store, op, runs) = (holder.clone(), op.clone(), runs.clone());
        async move {
            op.run(&store, &key, None, held_body(runs, started, wait, 1))
                .await
        }
    });
    has_started.await.unwrap();
    let token = operator
        .inspect(&key)
        .await
        .unwrap()
        .unwrap()
        .token()
        .unwrap();
    assert_eq!(
        Admin::release(&operator, &key, token, Release::Force)
            .await
            .unwrap(),
        Verdict::Done
    );
    go.send(()).unwrap();
    match first.await.unwrap() {
        Err(Error::Unrecorded(why)) => assert!(why.to_string().contains("operator"), "{why}"),
        other => panic!("the holder released elsewhere was answered {other:?}"),
    }
    assert!(
        released(operator.inspect(&key).await.unwrap()),
        "the released holder recorded nothing"
    );
    let next = op
        .run(&operator, &key, None, async { Ok::<_, Error>(2_u32) })
        .await
        .unwrap();
    assert_eq!(next, Outcome::Executed(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_elsewhere_records_nothing_after_a_forced_release_on_every_shared_store() {
    let prefix = namespace("admin.elsewhere");
    if let (Some(holder), Some(operator)) = (
        redis_store("admin.elsewhere").await,
        redis_store("admin.elsewhere").await,
    ) {
        // One prefix for both handles: the same records.
        let shared = format!("{}:", namespace("admin.elsewhere.shared"));
        let operator = operator.with_prefix(&shared).unwrap();
        let holder = holder.with_prefix(&shared).unwrap();
        a_holder_elsewhere_records_nothing_after_a_forced_release(holder, operator, &prefix).await;
    }
    if let (Some(holder), Some(operator)) = (
        idem_tests::dynamodb_store().await,
        idem_tests::dynamodb_store().await,
    ) {
        a_holder_elsewhere_records_nothing_after_a_forced_release(holder, operator, &prefix).await;
    }
    if let (Some(holder), Some(operator)) = (
        idem_tests::postgres_store().await,
        idem_tests::postgres_store().await,
    ) {
        a_holder_elsewhere_records_nothing_after_a_forced_release(holder, operator, &prefix).await;
    }
    if let (Some(holder), Some(operator)) = (
        idem_tests::mysql_store().await,
        idem_tests::mysql_store().await,
    ) {
        a_holder_elsewhere_records_nothing_after_a_forced_release(holder, operator, &prefix).await;
    }
    let (holder, path) = sqlite_store_at("elsewhere").await;
    let operator = idem_runtime::SqliteStore::open(&path).await.unwrap();
    a_holder_elsewhere_records_nothing_after_a_forced_release(holder, operator, &prefix).await;
}

/// A private 3-master cluster (or the one `IDEM_REDIS_CLUSTER_URLS` names): a listing walks
/// every master, a release and a reset reach the key's master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_is_operated_safely() {
    let (urls, _cluster) = match std::env::var("IDEM_REDIS_CLUSTER_URLS") {
        Ok(urls) => (urls.split(',').map(str::to_string).collect(), None),
        Err(_) => {
            let Some(cluster) = idem_tests::PrivateRedisCluster::start() else {
                return;
            };
            (cluster.urls(), Some(cluster))
        }
    };
    let store =
        match idem_runtime::RedisStore::connect_cluster(urls.iter().map(String::as_str)).await {
            Ok(store) => store
                .with_prefix(&format!("{}:", namespace("admin.cluster")))
                .unwrap(),
            Err(e) => {
                let _: Option<()> =
                    idem_tests::unavailable(&format!("the redis cluster at {urls:?}"), e);
                return;
            }
        };
    let prefix = namespace("admin.cluster");
    operations(store.clone(), &prefix).await;
    let keys = recorded(&store, &prefix, 250).await;
    listed(&store, &prefix, 100, keys.clone(), Order::AtLeastOnce).await;
    listed(&store, &prefix, 7, keys, Order::AtLeastOnce).await;
}

/// Through a Sentinel (a private primary, its replica and a sentinel): every promise of
/// the API on the primary the sentinel names; then the primary is killed, and the same
/// store, never reconnected by hand, lists what the replica kept and releases a claim made
/// before the failover on the promoted primary, never on the replica it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_sentinel_store_is_operated_on_its_primary_across_a_failover() {
    use idem_tests::failover::until;
    use idem_tests::sentinel::{command, fast_sync, replica_of, PrivateSentinel};

    let Some(mut primary) = idem_tests::PrivateRedis::start_with_args(&fast_sync()) else {
        return;
    };
    let Some(replica) = replica_of(&primary).await else {
        return;
    };
    let Some(sentinel) = PrivateSentinel::start(&primary).await else {
        return;
    };
    let store = idem_runtime::RedisStore::connect_sentinel([sentinel.url.as_str()], "idem")
        .await
        .unwrap();
    let prefix = namespace("admin.sentinel");
    operations(store.clone(), &prefix).await;

    // A claim another process holds, and a completed call, both on the replica before the
    // primary dies.
    let op = Operation::new(format!("{prefix}.failover")).lease(Duration::from_secs(300));
    let (held, done) = (op.key(&1_u32).unwrap(), op.key(&2_u32).unwrap());
    let Claim::Acquired { token, .. } = store
        .claim(
            &ClaimRequest::new(&held, Duration::from_secs(300))
                .nonce(7)
                .claimant(Claimant::new(op.namespace())),
        )
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    let _ = op
        .run(&store, &done, None, async { Ok::<_, Error>(2_u32) })
        .await
        .unwrap();
    // The replica has both: `WAIT` asked again until it says so (a busy machine may not
    // within one wait).
    until("the replica's acknowledgement", || async {
        command(&primary.url, redis::cmd("WAIT").arg(1).arg(1_000)).await
            == Ok(redis::Value::Int(1))
    })
    .await;

    primary.kill();
    sentinel.promoted(&replica).await;

    // The listing reaches the promoted primary (the store follows the sentinel; while it
    // settles, an operation fails, never answers from a server that is not the primary).
    let filter = Filter::namespace(format!("{prefix}.failover"));
    until("the store's view of the promoted primary", || async {
        store
            .list(&filter, None)
            .await
            .inspect_err(|why| eprintln!("retrying after: {why}"))
            .is_ok()
    })
    .await;
    let entries = listing(&store, &filter).await;
    let states = |key: &idem_runtime::Key| {
        entries
            .iter()
            .filter(|e| e.key() == key)
            .map(|e| e.state())
            .collect::<Vec<_>>()
    };
    assert_eq!(states(&held), [State::Held], "{entries:?}");
    assert_eq!(states(&done), [State::Completed], "{entries:?}");
    // Renewed just now, by a holder whose process lives: refused unless forced.
    assert!(matches!(
        Admin::release(&store, &held, token, Release::IfSilent)
            .await
            .unwrap(),
        Verdict::Refused(Refusal::Live { .. })
    ));
    assert_eq!(
        Admin::release(&store, &held, token, Release::Force)
            .await
            .unwrap(),
        Verdict::Done
    );
    // Written on the promoted primary: the next call runs at once and records.
    let ran = op
        .clone()
        .wait(Duration::ZERO)
        .run(&store, &held, None, async { Ok::<_, Error>(1_u32) })
        .await
        .unwrap();
    assert_eq!(ran, Outcome::Executed(1));
    assert_eq!(
        Admin::reset(&store, &done, Release::IfSilent)
            .await
            .unwrap(),
        Verdict::Done
    );
    assert!(store.inspect(&done).await.unwrap().is_none(), "forgotten");
}

/// A fresh SQLite file of its own.
async fn sqlite_store(test: &str) -> idem_runtime::SqliteStore {
    sqlite_store_at(test).await.0
}

/// A fresh SQLite file of its own, and its path (for a second process's handle).
async fn sqlite_store_at(test: &str) -> (idem_runtime::SqliteStore, std::path::PathBuf) {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("admin-{test}-{}-{nanos}.db", std::process::id()));
    let store = idem_runtime::SqliteStore::open(&path).await.unwrap();
    store.migrate().await.unwrap();
    (store, path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_is_operated_safely() {
    let store = sqlite_store("operated").await;
    operations(store.clone(), &namespace("admin.sqlite")).await;
    paging(store, &namespace("admin.sqlite")).await;
}

/// A tier of memory in front of SQLite: the durable store's records, and a reset that
/// forgets the fast tier's copy too (else the rerun in `operations` would replay it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_is_operated_on_both_tiers() {
    let store = idem_runtime::TieredStore::new(MemoryStore::new(), sqlite_store("tier").await);
    operations(store.clone(), &namespace("admin.tier")).await;
    paging(store, &namespace("admin.tier")).await;
}

/// A call's steps are shown by `inspect` while it runs (what an operator reads of a body
/// that died mid-way), never listed as calls, and forgotten with their call by `reset`.
async fn steps_go_with_their_call<S: Store + Admin + Clone + 'static>(store: S, prefix: &str) {
    let op = Operation::new(format!("{prefix}.stepped"));
    let key = op.key(&1_u32).unwrap();
    let (stepped, has_stepped) = oneshot::channel();
    let (go, wait) = oneshot::channel::<()>();
    let call = tokio::spawn({
        let (store, op) = (store.clone(), op.clone());
        async move {
            op.run(&store, &key, None, async {
                let a: u32 = idem_runtime::step("a", async { Ok::<_, Error>(1_u32) }).await?;
                let b: u32 = idem_runtime::step("b", async { Ok::<_, Error>(2_u32) }).await?;
                let _ = stepped.send(());
                let _ = wait.await;
                Ok::<_, Error>(a + b)
            })
            .await
        }
    });
    has_stepped.await.unwrap();
    let page = listing(&store, &Filter::namespace(prefix)).await;
    assert_eq!(
        page.iter().map(|e| *e.key()).collect::<Vec<_>>(),
        [key],
        "the steps are not listed as calls"
    );
    let entry = store.inspect(&key).await.unwrap().unwrap();
    assert_eq!(entry.state(), State::Held);
    assert_eq!(entry.steps().len(), 2, "{entry:?}");
    go.send(()).unwrap();
    assert_eq!(call.await.unwrap().unwrap(), Outcome::Executed(3));
    assert_eq!(
        store.reset(&key, Release::IfSilent).await.unwrap(),
        Verdict::Done
    );
    assert!(
        store.steps(&key).await.unwrap().is_empty(),
        "the steps went with the call"
    );
    assert!(store.inspect(&key).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_go_with_their_call_on_every_store() {
    steps_go_with_their_call(MemoryStore::new(), &namespace("admin.steps")).await;
    steps_go_with_their_call(sqlite_store("steps").await, &namespace("admin.steps")).await;
    if let Some(store) = idem_tests::postgres_store().await {
        steps_go_with_their_call(store, &namespace("admin.steps")).await;
    }
    if let Some(store) = idem_tests::mysql_store().await {
        steps_go_with_their_call(store, &namespace("admin.steps")).await;
    }
    if let Some(store) = redis_store("admin.steps").await {
        steps_go_with_their_call(store, &namespace("admin.steps")).await;
    }
    if let Some(store) = idem_tests::dynamodb_store().await {
        steps_go_with_their_call(store, &namespace("admin.steps")).await;
    }
}

/// A table made by an earlier version (no columns for whose a record is): `migrate`
/// upgrades it in place, its rows stay and list as "namespace unknown", and new claims
/// say whose they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_table_is_upgraded_in_place_on_postgres() {
    let Some(shared) = idem_tests::postgres_store().await else {
        return;
    };
    let pool = shared.pool().clone();
    let table = format!("admin_upgrade_{}", std::process::id());
    // The schema of the version before, with one completed row in it.
    sqlx::raw_sql(&format!(
        "DROP TABLE IF EXISTS {table}; DROP SEQUENCE IF EXISTS {table}_token; \
         DROP FUNCTION IF EXISTS {table}_claim_in_transaction; \
         CREATE TABLE {table} (key bytea PRIMARY KEY, token bigint NOT NULL, \
            completed boolean NOT NULL, fingerprint bytea, value bytea, \
            expires_at timestamptz NOT NULL); \
         CREATE SEQUENCE {table}_token START 100; \
         INSERT INTO {table} VALUES (decode(repeat('ab', 32), 'hex'), 1, true, NULL, \
            decode('7634', 'hex'), now() + interval '1 hour')"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let store = idem_runtime::PostgresStore::from_pool(pool.clone())
        .with_table(&table)
        .unwrap();
    store.migrate().await.unwrap();
    let old = idem_runtime::Key::from_bytes([0xab; 32]);
    let entry = store
        .inspect(&old)
        .await
        .unwrap()
        .expect("the old row stays");
    assert_eq!(entry.namespace(), None, "namespace unknown");
    assert_eq!(entry.state(), State::Completed);
    assert_eq!(entry.value_json(), Some("4"));
    let op = Operation::new("admin.upgraded");
    let key = op.key(&1_u32).unwrap();
    let _ = op
        .run(&store, &key, None, async { Ok::<_, Error>(1_u32) })
        .await
        .unwrap();
    let all = store.list(&Filter::all(), None).await.unwrap();
    let names: Vec<_> = all.entries().iter().map(|e| e.namespace()).collect();
    assert_eq!(names.len(), 2);
    assert!(names.contains(&None) && names.contains(&Some("admin.upgraded")));
    // A second migrate finds it current.
    store.migrate().await.unwrap();
    idem_tests::drop_store_objects(&pool, &table).await;
}

/// How many records the large listings hold.
const MANY: usize = 100_000;

/// The `MANY` completed records of `namespace` on `store`, listed in pages of 1 000 until
/// `next` is `None`: each page within the bound, every record of the namespace and no
/// other, as often and in the order `order` says. How many pages it took.
async fn many_listed<S: Admin>(store: &S, namespace: &str, order: Order) -> usize {
    let filter = Filter::namespace(namespace).limit(1_000);
    let (mut listed, mut pages, mut cursor) = (0_usize, 0_usize, None);
    let mut keys = std::collections::HashSet::with_capacity(MANY);
    let mut last = None;
    loop {
        let page = store.list(&filter, cursor.as_ref()).await.unwrap();
        assert!(page.entries().len() <= 1_000);
        for entry in page.entries() {
            assert_eq!(entry.namespace(), Some(namespace));
            assert_eq!(entry.state(), State::Completed);
            assert!(entry.value().is_none(), "no value unless asked for");
            if order == Order::Keys {
                assert!(
                    last.is_none_or(|last| last < *entry.key()),
                    "in key order, once"
                );
                last = Some(*entry.key());
            }
            keys.insert(*entry.key());
        }
        listed += page.entries().len();
        pages += 1;
        match page.next() {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    assert_eq!(keys.len(), MANY, "every record ({listed} listed)");
    if order != Order::AtLeastOnce {
        assert_eq!(listed, MANY, "each once");
    }
    pages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_100_000_records_stays_paged_on_postgres() {
    let Some(shared) = idem_tests::postgres_store().await else {
        return;
    };
    let pool = shared.pool().clone();
    let table = format!("admin_many_{}", std::process::id());
    let store = idem_runtime::PostgresStore::from_pool(pool.clone())
        .with_table(&table)
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::raw_sql(&format!(
        "INSERT INTO {table} (key, token, completed, value, expires_at, namespace, lease_ms) \
         SELECT sha256(n::text::bytea), n, true, decode('7631', 'hex'), now() + interval '1 hour', \
            'admin.many', 1000 \
         FROM generate_series(1, {MANY}) AS n"
    ))
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(many_listed(&store, "admin.many", Order::Keys).await, 100);
    assert_eq!(store.purge().await.unwrap(), 0, "nothing expired");
    idem_tests::drop_store_objects(&pool, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_100_000_records_stays_paged_on_mysql() {
    let Some(shared) = idem_tests::mysql_store().await else {
        return;
    };
    let pool = shared.pool().clone();
    let table = format!("admin_many_{}", std::process::id());
    let store = idem_runtime::MySqlStore::from_pool(pool.clone())
        .with_table(&table)
        .unwrap();
    store.migrate().await.unwrap();
    // 10^5 numbers from five digits, without a recursion limit to raise.
    let digits = "(SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
        UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
        UNION ALL SELECT 8 UNION ALL SELECT 9)";
    sqlx::raw_sql(&format!(
        "INSERT INTO {table} (`key`, completed, value, expires_at, namespace, lease_ms) \
         SELECT UNHEX(SHA2(a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d, 256)), 1, \
            X'7631', UNIX_TIMESTAMP() * 1000 + 3600000, 'admin.many', 1000 \
         FROM {digits} a, {digits} b, {digits} c, {digits} e, {digits} f"
    ))
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(many_listed(&store, "admin.many", Order::Keys).await, 100);
    assert_eq!(store.purge().await.unwrap(), 0, "nothing expired");
    sqlx::raw_sql(&format!("DROP TABLE {table}"))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_100_000_records_stays_paged_on_sqlite() {
    let store = sqlite_store("many").await;
    sqlx::raw_sql(&format!(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {MANY}) \
         INSERT INTO idem_records (key, token, completed, value, expires_at, namespace, lease_ms) \
         SELECT randomblob(32), i, 1, X'7631', \
            CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) + 3600000, 'admin.many', 1000 \
         FROM n"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    assert_eq!(many_listed(&store, "admin.many", Order::Keys).await, 100);
    assert_eq!(store.purge().await.unwrap(), 0, "nothing expired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_100_000_records_stays_paged_in_memory() {
    let store = MemoryStore::builder().capacity(MANY as u64).build();
    let op = Operation::new("admin.many");
    for n in 0..MANY as u32 {
        let key = op.key(&n).unwrap();
        let _ = op
            .run(&store, &key, None, async { Ok::<_, Error>(1_u8) })
            .await
            .unwrap();
    }
    assert_eq!(many_listed(&store, "admin.many", Order::Keys).await, 100);
}

/// On Redis the records are copies of one the store wrote (a completed record and its
/// `about`), under keys of their own, written a thousand to a pipeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_100_000_records_stays_paged_on_redis() {
    let prefix = format!("{}:", namespace("admin.many"));
    let Some(store) = idem_tests::redis_store().await else {
        return;
    };
    let store = store.with_prefix(&prefix).unwrap();
    let op = Operation::new("admin.many");
    let first = op.key(&0_u32).unwrap();
    let _ = op
        .run(&store, &first, None, async { Ok::<_, Error>(1_u8) })
        .await
        .unwrap();
    let client = redis::Client::open(idem_tests::redis_url()).unwrap();
    let mut redis = client.get_multiplexed_async_connection().await.unwrap();
    let name = |key: &idem_runtime::Key| format!("{prefix}{{{}}}", key.to_hex());
    let (record, about): (Vec<u8>, Vec<u8>) = redis::pipe()
        .get(name(&first))
        .get(format!("{}:about", name(&first)))
        .query_async(&mut redis)
        .await
        .unwrap();
    for chunk in (1..MANY as u32).collect::<Vec<_>>().chunks(1_000) {
        let mut pipe = redis::pipe();
        for n in chunk {
            let key = op.key(n).unwrap();
            pipe.set_ex(name(&key), &record, 3_600)
                .ignore()
                .set_ex(format!("{}:about", name(&key)), &about, 3_600)
                .ignore();
        }
        let () = pipe.query_async(&mut redis).await.unwrap();
    }
    let pages = many_listed(&store, "admin.many", Order::AtLeastOnce).await;
    assert!(pages >= 100, "{pages} pages of at most 1 000");
    // The test's keys go with it (no KEYS on a shared server: a script of SCAN steps).
    let pattern = format!("{prefix}*");
    let mut cursor = 0_u64;
    loop {
        let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1_000)
            .query_async(&mut redis)
            .await
            .unwrap();
        if !found.is_empty() {
            let () = redis::cmd("UNLINK")
                .arg(&found)
                .query_async(&mut redis)
                .await
                .unwrap();
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
}

/// On DynamoDB the records are copies of one item the store wrote, under ids of their own,
/// in a table of the test's own, written 25 to a `BatchWriteItem`, 16 batches at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_100_000_records_stays_paged_on_dynamodb() {
    use aws_sdk_dynamodb::types::{AttributeValue, PutRequest, WriteRequest};

    let Some(url) = idem_tests::dynamodb_endpoint().await else {
        return;
    };
    let client = idem_tests::dynamodb_client(&url);
    let table = format!("admin_many_{}", std::process::id());
    let store = idem_runtime::DynamoDbStore::new(client.clone(), table.as_str());
    store.migrate().await.unwrap();
    let op = Operation::new("admin.many");
    let first = op.key(&0_u32).unwrap();
    let _ = op
        .run(&store, &first, None, async { Ok::<_, Error>(1_u8) })
        .await
        .unwrap();
    let item = client
        .get_item()
        .table_name(&table)
        .key("id", AttributeValue::S(first.to_hex()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
        .expect("the record the store wrote");
    let requests: Vec<WriteRequest> = (1..MANY as u32)
        .map(|n| {
            let mut copy = item.clone();
            copy.insert("id".into(), AttributeValue::S(op.key(&n).unwrap().to_hex()));
            let put = PutRequest::builder().set_item(Some(copy)).build().unwrap();
            WriteRequest::builder().put_request(put).build()
        })
        .collect();
    let mut batches = tokio::task::JoinSet::new();
    for batch in requests.chunks(25) {
        if batches.len() == 16 {
            batches.join_next().await.unwrap().unwrap();
        }
        let (client, table, mut batch) = (client.clone(), table.clone(), batch.to_vec());
        batches.spawn(async move {
            // What a batch leaves unprocessed is sent again.
            while !batch.is_empty() {
                let written = client
                    .batch_write_item()
                    .request_items(&table, batch)
                    .send()
                    .await
                    .unwrap();
                batch = written
                    .unprocessed_items
                    .and_then(|mut left| left.remove(&table))
                    .unwrap_or_default();
            }
        });
    }
    while let Some(done) = batches.join_next().await {
        done.unwrap();
    }
    let pages = many_listed(&store, "admin.many", Order::Once).await;
    assert!(pages >= 100, "{pages} pages of at most 1 000");
    client
        .delete_table()
        .table_name(&table)
        .send()
        .await
        .unwrap();
}

/// `wait = "2s"` beside a holder of a five-minute lease: `InProgress` after the two
/// seconds, not the lease; in this process (the holder's flight) and from another (a claim
/// the store holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_waits_as_long_as_it_is_told_then_answers_in_progress() {
    static STORE: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);
    fn wait_store() -> &'static MemoryStore {
        &STORE
    }

    #[idempotent(key = id, store = wait_store(), namespace = "admin.wait.v1", lease = "5m", wait = "2s", ignore = (started, go))]
    async fn charge(
        id: u32,
        started: oneshot::Sender<()>,
        go: oneshot::Receiver<()>,
    ) -> Result<u32, Error> {
        let _ = started.send(());
        let _ = go.await;
        Ok(id)
    }

    let (go, wait) = oneshot::channel();
    let (started, has_started) = oneshot::channel();
    let first = tokio::spawn(charge(1, started, wait));
    has_started.await.unwrap();
    let asked = Instant::now();
    let (_unused, never) = oneshot::channel();
    let (unheard, _) = oneshot::channel();
    assert!(matches!(
        charge(1, unheard, never).await,
        Err(Error::InProgress)
    ));
    assert!(
        asked.elapsed() >= Duration::from_secs(2),
        "{:?}",
        asked.elapsed()
    );
    go.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), 1);

    // Held by a claim of "another process": the duplicate polls the store for its wait.
    let store = MemoryStore::new();
    let op = Operation::new("admin.wait.v1")
        .lease(Duration::from_secs(300))
        .wait(Duration::from_secs(2));
    let key = op.key(&2_u32).unwrap();
    let claimant = Claimant::new("admin.wait.v1");
    assert!(matches!(
        store
            .claim(
                &ClaimRequest::new(&key, Duration::from_secs(300))
                    .nonce(1)
                    .claimant(claimant)
            )
            .await,
        Ok(Claim::Acquired { .. })
    ));
    let asked = Instant::now();
    let waited = op
        .run(&store, &key, None, async { Ok::<_, Error>(0_u32) })
        .await;
    assert!(matches!(waited, Err(Error::InProgress)), "{waited:?}");
    assert!(waited.unwrap_err().is_transient());
    assert!(asked.elapsed() >= Duration::from_secs(2));
}

/// Whether an operator's release ended the claim `entry` shows: no record (Redis deletes
/// it, DynamoDB marks it released), or the claim lapsed (memory, the SQL stores keep it,
/// lapsed, for the next claim to be told it takes over a call whose outcome is unknown).
/// Never a live claim, nor a result.
fn released(entry: Option<Entry>) -> bool {
    entry.is_none_or(|entry| entry.state() == State::Lapsed)
}

/// A holder whose lease ran out while its body blocked the only thread (no renewal could be
/// sent), nobody taking the key meanwhile, records its result all the same: on a store
/// where the lapsed claim is gone (Redis), by claiming the key again, which carries the
/// call's namespace and label as the first claim did. Either way the record lists under
/// its namespace, with its label, and is found by a filter of either.
async fn recorded_after_its_lease<S: Store + Admin + Clone>(store: S, prefix: &str) {
    let lease = Duration::from_millis(200);
    let op = Operation::new(format!("{prefix}.late")).lease(lease);
    let key = op.key(&1_u32).unwrap();
    let done = idem_runtime::labelled(
        "order 1",
        op.run(&store, &key, None, async move {
            // The current-thread runtime runs nothing else meanwhile: no renewal.
            std::thread::sleep(lease * 3);
            Ok::<_, Error>(1_u32)
        }),
    )
    .await
    .unwrap();
    assert_eq!(done, Outcome::Executed(1));
    let entry = store
        .inspect(&key)
        .await
        .unwrap()
        .expect("the result is recorded");
    assert_eq!(entry.state(), State::Completed);
    assert_eq!(entry.namespace(), Some(op.namespace()), "{entry:?}");
    assert_eq!(entry.label(), Some("order 1"), "{entry:?}");
    let by_namespace = listing(&store, &Filter::namespace(op.namespace())).await;
    assert!(
        by_namespace.iter().any(|e| e.key() == &key),
        "{by_namespace:?}"
    );
    let by_label = listing(&store, &Filter::namespace(prefix).label("order 1")).await;
    assert_eq!(by_label.len(), 1, "{by_label:?}");
}

#[tokio::test]
async fn a_record_completed_after_its_lease_ran_out_lists_under_its_namespace() {
    let prefix = namespace("admin.late");
    recorded_after_its_lease(MemoryStore::new(), &prefix).await;
    if let Some(store) = redis_store("admin.late").await {
        recorded_after_its_lease(store, &prefix).await;
    }
    if let Some(store) = idem_tests::postgres_store().await {
        recorded_after_its_lease(store, &prefix).await;
    }
    if let Some(store) = idem_tests::mysql_store().await {
        recorded_after_its_lease(store, &prefix).await;
    }
    if let Some(store) = idem_tests::dynamodb_store().await {
        recorded_after_its_lease(store, &prefix).await;
    }
    let (store, _) = sqlite_store_at("late").await;
    recorded_after_its_lease(store, &prefix).await;
}
