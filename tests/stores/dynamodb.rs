//! `DynamoDbStore` against a DynamoDB emulator (`dynoxide`) over real HTTP: the store
//! contract, one body for a crowd across processes' stores, a SIGKILLed holder, zombies and
//! their fences, requests dropped before and after the emulator acted, replies that came too
//! late, results over the item limit, waiters that read, the units billed, and items an
//! operator can read.
//!
//! The same tests run three ways: against dynoxide; through the conformance proxy
//! (`IDEM_DYNAMODB_CONFORMANCE=1`, `tests/support/dynamodb_conformance.rs`), which answers as
//! AWS's documentation allows and dynoxide does not; and against moto, a second
//! implementation (`IDEM_DYNAMODB_URL=http://127.0.0.1:5055 IDEM_DYNAMODB_LACKS=atomic,capacity`,
//! as `.ci/run` does), where the tests that need atomic conditional updates or AWS's
//! capacity figures say so and are skipped.
//!
//! Over the suite's 600 lines for a reason: it is one store's whole behaviour, short tests
//! sharing this file's helpers (the emulator's client, the proxy, the items as an operator
//! reads them), like each store's file; split by concern, those helpers would move to a
//! module for nothing.

use idem_runtime::ClaimRequest;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::AttributeValue;
use idem_runtime::testkit;
use idem_runtime::{DynamoDbStore, Error, Operation, Store};
use idem_tests::scenarios::{self, namespace};
use idem_tests::{dynamodb_client, dynamodb_endpoint, dynamodb_store, DYNAMODB_TABLE};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_store_keeps_the_store_contract() {
    if idem_tests::dynamodb_lacks("atomic") {
        return;
    }
    let (Some(store), Some(other)) = (dynamodb_store().await, dynamodb_store().await) else {
        return;
    };
    testkit::conformance(&store).await;
    testkit::conformance_across(&store, &other).await;
}

/// Two stores are two processes: neither has seen what the other claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_with_200_callers_each_run_the_body_once() {
    if idem_tests::dynamodb_lacks("atomic") {
        return;
    }
    let Some(first) = dynamodb_store().await else {
        return;
    };
    let Some(second) = dynamodb_store().await else {
        return;
    };
    scenarios::two_stores_200_callers_each(first, second).await;
}

/// Four stores (four processes, in effect: each its own client and registry), 50 callers
/// each, spread over 20 keys: every key's body runs exactly once, and every caller gets its
/// key's value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_stores_of_50_callers_on_20_keys_run_each_body_once() {
    if idem_tests::dynamodb_lacks("atomic") {
        return;
    }
    let Some(_) = dynamodb_store().await else {
        return;
    };
    let url = dynamodb_endpoint().await.unwrap();
    let stores = (0..4)
        .map(|_| DynamoDbStore::new(dynamodb_client(&url), DYNAMODB_TABLE))
        .collect();
    scenarios::stores_with_callers_on_keys_run_each_body_once(stores, 50, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_lost_its_lease_cannot_overwrite_the_new_owner() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    scenarios::zombie_cannot_overwrite_the_new_owner(store.clone()).await;
    scenarios::a_lapsed_holder_answers_only_what_the_key_records(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombies_fenced_write_is_refused_downstream() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    scenarios::zombie_fences_are_refused_downstream(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child of a_sigkilled_holder_is_taken_over_after_its_lease"]
async fn crash_child() {
    let store = dynamodb_store()
        .await
        .expect("the parent found the emulator");
    scenarios::crash_child(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child of a_holder_sigkilled_after_a_renewal_frees_its_key_within_10s"]
async fn default_lease_crash_child() {
    let store = dynamodb_store()
        .await
        .expect("the parent found the emulator");
    scenarios::default_lease_crash_child(store).await;
}

/// A process claims with a 1 s lease and is SIGKILLed: this process is refused while the
/// lease can last and runs the body after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_holder_is_taken_over_after_its_lease() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    scenarios::crash_frees_the_key_after_the_lease(store, "crash_child").await;
}

/// With the default lease (8 s), killed right after a renewal, and first seen held here
/// after the kill: the key runs again within 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_sigkilled_after_a_renewal_frees_its_key_within_10s() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    scenarios::a_crashed_holder_frees_its_key_within_seconds(store, "default_lease_crash_child")
        .await;
}

/// DynamoDB has no clock a condition can read: a claim is taken over once this process has
/// seen it unchanged for its lease, by its own clock. A process that first looks after the
/// holder's lease ran out by every clock still waits a lease from that look; the holder's
/// late completion is then refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_claim_is_taken_a_lease_after_this_process_first_sees_it() {
    const LEASE: Duration = Duration::from_secs(1);
    let Some(holder) = dynamodb_store().await else {
        return;
    };
    let key = Operation::new(namespace("dynamodb.first_sight"))
        .key(&1)
        .unwrap();
    let idem_runtime::Claim::Acquired { token, .. } =
        holder.claim(&ClaimRequest::new(&key, LEASE)).await.unwrap()
    else {
        panic!("a fresh key is free")
    };
    // The holder's lease is over by every clock before the other process looks.
    tokio::time::sleep(LEASE + LEASE / 2).await;
    let url = dynamodb_endpoint().await.unwrap();
    let other = DynamoDbStore::new(dynamodb_client(&url), DYNAMODB_TABLE);
    let first_look = Instant::now();
    assert_eq!(
        other.claim(&ClaimRequest::new(&key, LEASE)).await.unwrap(),
        idem_runtime::Claim::InProgress { fingerprint: None },
        "a claim seen for the first time is not taken"
    );
    let left = other.lease_left(&key).await.unwrap();
    assert!(left.is_some_and(|left| left <= LEASE), "{left:?}");
    let taken = loop {
        match other.claim(&ClaimRequest::new(&key, LEASE)).await.unwrap() {
            idem_runtime::Claim::Acquired { token, .. } => break token,
            idem_runtime::Claim::InProgress { .. } => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            found => panic!("{found:?}"),
        }
    };
    assert!(
        first_look.elapsed() >= LEASE,
        "taken {:?} after the first look, within its lease",
        first_look.elapsed()
    );
    assert!(
        taken > token,
        "the takeover's token is larger: {taken:?} after {token:?}"
    );
    assert!(
        !holder
            .complete(&key, token, "late".into(), Duration::from_secs(60))
            .await
            .unwrap(),
        "the dead holder's late completion is refused"
    );
}

/// The item of `key`, as an operator reads it in the console.
async fn item(
    store_url: &str,
    key: &idem_runtime::Key,
) -> std::collections::HashMap<String, AttributeValue> {
    dynamodb_client(store_url)
        .get_item()
        .table_name(DYNAMODB_TABLE)
        .key("id", AttributeValue::S(key.to_hex()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
        .expect("the key's item")
}

fn text(item: &std::collections::HashMap<String, AttributeValue>, name: &str) -> String {
    match item.get(name) {
        Some(AttributeValue::S(text)) => text.clone(),
        other => panic!("`{name}` is {other:?}"),
    }
}

/// An operator finds a stuck claim by its state and lease in plain attributes, the result
/// once completed, and DynamoDB's TTL attribute in seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_says_its_state_in_plain_attributes() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    let url = dynamodb_endpoint().await.unwrap();
    let op = Operation::new(namespace("dynamodb.items"));
    let key = op.key(&1).unwrap();
    let (entered, mut has_entered) = tokio::sync::mpsc::channel(1);
    let (go, mut wait) = tokio::sync::mpsc::channel::<()>(1);
    let running = tokio::spawn({
        let (op, store) = (op.clone(), store.clone());
        async move {
            op.run(&store, &key, None, async {
                entered.send(()).await.unwrap();
                wait.recv().await;
                Ok::<_, Error>(42_u32)
            })
            .await
        }
    });
    has_entered.recv().await.unwrap();
    let held = item(&url, &key).await;
    assert_eq!(text(&held, "state"), "IN_PROGRESS");
    assert!(matches!(held.get("lease_ms"), Some(AttributeValue::N(ms)) if ms == "8000"));
    assert!(held.contains_key("token") && held.contains_key("renewed_at"));
    go.send(()).await.unwrap();
    let _ = running.await.unwrap().unwrap();
    let done = item(&url, &key).await;
    assert_eq!(text(&done, "state"), "COMPLETED");
    let Some(AttributeValue::B(value)) = done.get("value") else {
        panic!("no value: {done:?}")
    };
    // The engine's encoding: a version byte, then the value's JSON.
    assert_eq!(value.as_ref(), b"v42", "the recorded result");
    let Some(AttributeValue::N(expiration)) = done.get("expiration") else {
        panic!("no TTL attribute: {done:?}")
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let expiration: u64 = expiration.parse().unwrap();
    assert!(
        expiration > now + 23 * 3600 && expiration <= now + 24 * 3600 + 1,
        "DynamoDB's TTL is in seconds, a day from now: {expiration} at {now}"
    );
}

// ---- Requests dropped before and after the emulator acted ----------------------------------

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An HTTP proxy in front of the emulator that drops a seeded share of the requests: half
/// before forwarding them (the emulator never sees them), half after the emulator answered
/// (it acted; the client never hears). A dropped request's connection is closed without an
/// answer, as a network that lost it would leave it.
struct DroppingProxy {
    port: u16,
    fates: Arc<Fates>,
}

/// What the proxy's connections share: what it does, and what it did.
struct Fates {
    client: Upstream,
    upstream: String,
    rng: Mutex<XorShiftRng>,
    drop: f64,
    /// How many of the next requests are dropped after the emulator acted, whatever the seed.
    drop_next_after: AtomicUsize,
    /// How many of the next writes that land lose their replies: the emulator acted, and
    /// no answer ever comes (the store gives up after its timeout).
    lose_next_landed: AtomicUsize,
    /// Whether every request is held without an answer, the emulator never seeing it: a
    /// stalled table.
    stalled: std::sync::atomic::AtomicBool,
    /// Whether requests ask for the capacity they consume (`ReturnConsumedCapacity`, added
    /// to the request; the emulator checks no signature), and what each consumed, in order.
    capacity: std::sync::atomic::AtomicBool,
    consumed: Mutex<Vec<(String, f64)>>,
    /// Whether a failed condition's answer loses the item it returns, as an endpoint without
    /// `ReturnValuesOnConditionCheckFailure` answers.
    strip_failed_items: std::sync::atomic::AtomicBool,
    dropped_before: AtomicUsize,
    dropped_after: AtomicUsize,
    forwarded: AtomicUsize,
    /// The SDK's invocations forwarded, by their `amz-sdk-invocation-id` (the same on each
    /// of an invocation's retries), with their operation: the store's own requests, however
    /// often the SDK sent one.
    invocations: Mutex<std::collections::HashMap<String, String>>,
}

impl std::ops::Deref for DroppingProxy {
    type Target = Fates;

    fn deref(&self) -> &Fates {
        &self.fates
    }
}

impl DroppingProxy {
    async fn start(upstream: String, seed: u64, drop: f64) -> Self {
        use hyper_util::client::legacy::Client;
        use hyper_util::rt::{TokioExecutor, TokioIo};

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let fates = Arc::new(Fates {
            client: Client::builder(TokioExecutor::new()).build_http(),
            upstream,
            rng: Mutex::new(XorShiftRng::seed_from_u64(seed)),
            drop,
            drop_next_after: AtomicUsize::new(0),
            lose_next_landed: AtomicUsize::new(0),
            stalled: false.into(),
            capacity: false.into(),
            consumed: Mutex::default(),
            strip_failed_items: false.into(),
            dropped_before: AtomicUsize::new(0),
            dropped_after: AtomicUsize::new(0),
            forwarded: AtomicUsize::new(0),
            invocations: Mutex::default(),
        });
        let proxy = Self {
            port: listener.local_addr().unwrap().port(),
            fates: Arc::clone(&fates),
        };
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let fates = Arc::clone(&fates);
                let service =
                    hyper::service::service_fn(move |request| Arc::clone(&fates).serve(request));
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        proxy
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// How many of the store's requests of `operation` (`UpdateItem`, `GetItem`) reached
    /// the emulator.
    fn requests(&self, operation: &str) -> usize {
        let invocations = self.invocations.lock().unwrap();
        invocations.values().filter(|op| *op == operation).count()
    }
}

type Upstream = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
>;

impl Fates {
    /// Forwards `request`, or drops it before or after the emulator acted.
    async fn serve(
        self: Arc<Self>,
        request: http::Request<hyper::body::Incoming>,
    ) -> Result<http::Response<http_body_util::Full<bytes::Bytes>>, BoxError> {
        if self.stalled.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let fate: f64 = self.rng.lock().unwrap().random();
        if fate < self.drop / 2.0 {
            self.dropped_before.fetch_add(1, Ordering::Relaxed);
            return Err("dropped before the emulator saw it".into());
        }
        let header = |name: &str| {
            request
                .headers()
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned)
        };
        let invocation = header("amz-sdk-invocation-id").zip(
            header("x-amz-target")
                .map(|target| target.trim_start_matches("DynamoDB_20120810.").to_owned()),
        );
        let request = if self.capacity.load(Ordering::SeqCst) {
            ask_capacity(request).await?
        } else {
            request.map(http_body_util::Either::Left)
        };
        let (mut parts, mut body) = forward(&self.client, &self.upstream, request).await?;
        if self.capacity.load(Ordering::SeqCst) {
            if let (Ok(answer), Some((_, operation))) = (
                serde_json::from_slice::<serde_json::Value>(&body),
                invocation.as_ref(),
            ) {
                if let Some(units) = answer["ConsumedCapacity"]["CapacityUnits"].as_f64() {
                    self.consumed
                        .lock()
                        .unwrap()
                        .push((operation.clone(), units));
                }
            }
        }
        let chosen = self
            .drop_next_after
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if chosen || fate < self.drop {
            self.dropped_after.fetch_add(1, Ordering::Relaxed);
            return Err("dropped after the emulator acted".into());
        }
        if self.strip_failed_items.load(Ordering::SeqCst) {
            if let Ok(mut failed) = serde_json::from_slice::<serde_json::Value>(&body) {
                let is_failed_condition = failed["__type"]
                    .as_str()
                    .is_some_and(|kind| kind.ends_with("ConditionalCheckFailedException"));
                if is_failed_condition && failed.as_object_mut().unwrap().remove("Item").is_some() {
                    body = serde_json::to_vec(&failed).unwrap().into();
                    parts.headers.remove(http::header::CONTENT_LENGTH);
                    parts.headers.remove("x-amz-crc32");
                }
            }
        }
        let landed_write = parts.status.is_success()
            && invocation
                .as_ref()
                .is_some_and(|(_, operation)| operation == "UpdateItem");
        if landed_write
            && self
                .lose_next_landed
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            std::future::pending::<()>().await;
        }
        self.forwarded.fetch_add(1, Ordering::Relaxed);
        if let Some((id, operation)) = invocation {
            self.invocations.lock().unwrap().insert(id, operation);
        }
        Ok(http::Response::from_parts(
            parts,
            http_body_util::Full::new(body),
        ))
    }
}

/// A request's body, as it came or as the proxy rewrote it.
type Body = http_body_util::Either<hyper::body::Incoming, http_body_util::Full<bytes::Bytes>>;

/// `request`, asking for the capacity it consumes.
async fn ask_capacity(
    request: http::Request<hyper::body::Incoming>,
) -> Result<http::Request<Body>, BoxError> {
    use http_body_util::BodyExt;

    let (mut parts, body) = request.into_parts();
    let body = body.collect().await?.to_bytes();
    let mut asked: serde_json::Value = serde_json::from_slice(&body)?;
    asked["ReturnConsumedCapacity"] = "TOTAL".into();
    parts.headers.remove(http::header::CONTENT_LENGTH);
    let body = serde_json::to_vec(&asked)?;
    Ok(http::Request::from_parts(
        parts,
        http_body_util::Either::Right(http_body_util::Full::new(body.into())),
    ))
}

/// Sends `request` on to `upstream` and reads the whole answer.
async fn forward(
    client: &Upstream,
    upstream: &str,
    request: http::Request<Body>,
) -> Result<(http::response::Parts, bytes::Bytes), BoxError> {
    use http_body_util::{BodyExt, Full};

    let (mut parts, body) = request.into_parts();
    let body = body.collect().await?.to_bytes();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = format!("{upstream}{path}")
        .parse()
        .map_err(BoxError::from)?;
    let answer = client
        .request(http::Request::from_parts(parts, Full::new(body)))
        .await
        .map_err(BoxError::from)?;
    let (parts, body) = answer.into_parts();
    let body = body.collect().await.map_err(BoxError::from)?.to_bytes();
    Ok((parts, body))
}

/// 200 keys, a caller on each of two stores (two processes) through the proxy, every caller
/// retrying until it gets a value (a call fails when its store's tries all time out or are
/// dropped, or when it waited out its wait for another): every key's body runs once, every
/// caller gets its key's value, and none hangs. The SDK sends a dropped request again (its
/// standard retries): a claim finds its own nonce, a settlement its own write id. At most 32
/// calls are in flight: on a busy machine, hundreds of them would spend the timeouts of
/// their requests on the test's own CPU, and retry for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_dropped_before_or_after_the_emulator_acted_run_every_body_once() {
    if idem_tests::dynamodb_lacks("atomic") {
        return;
    }
    const KEYS: u32 = 200;
    // A holder's completion and renewals must land within its lease: each try of one is
    // bounded by the store's timeout (3 s against the default 8 s), and the SDK sends a
    // dropped request again after 20 ms to 80 ms.
    const TRIES: usize = 50;
    let Some(direct) = dynamodb_store().await else {
        return;
    };
    let upstream = dynamodb_endpoint().await.unwrap();
    let proxies = [
        DroppingProxy::start(upstream.clone(), 7, 0.10).await,
        DroppingProxy::start(upstream, 8, 0.10).await,
    ];
    let stores = proxies
        .each_ref()
        .map(|proxy| DynamoDbStore::new(dynamodb_client(&proxy.url()), DYNAMODB_TABLE));
    let op = Operation::new(namespace("dynamodb.dropped"));
    let runs: Arc<Vec<AtomicUsize>> = Arc::new((0..KEYS).map(|_| AtomicUsize::new(0)).collect());
    let (failures, started) = (Arc::new(AtomicUsize::new(0)), Instant::now());
    let in_flight = Arc::new(tokio::sync::Semaphore::new(32));
    let mut callers = Vec::new();
    for key in 0..KEYS {
        for store in &stores {
            let (op, store, runs, failures, in_flight) = (
                op.clone(),
                store.clone(),
                Arc::clone(&runs),
                Arc::clone(&failures),
                Arc::clone(&in_flight),
            );
            callers.push(tokio::spawn(async move {
                let k = op.key(&key).unwrap();
                for _ in 0..TRIES {
                    let _turn = in_flight.acquire().await.unwrap();
                    let call = op.run(&store, &k, None, async {
                        runs[key as usize].fetch_add(1, Ordering::SeqCst);
                        Ok::<_, Error>(key)
                    });
                    match tokio::time::timeout(Duration::from_secs(60), call).await {
                        Ok(Ok(value)) => return value.into_inner(),
                        Ok(Err(_)) => {
                            failures.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => panic!("a call on key {key} hung for a minute"),
                    }
                }
                panic!("{TRIES} calls on key {key} failed in a row")
            }));
        }
    }
    for (i, caller) in callers.into_iter().enumerate() {
        assert_eq!(
            caller.await.unwrap(),
            i as u32 / 2,
            "a caller got another key's value"
        );
    }
    idem_runtime::drain(Duration::from_secs(30))
        .await
        .expect("background work drained");
    let ran: Vec<usize> = runs
        .iter()
        .map(|runs| runs.load(Ordering::SeqCst))
        .collect();
    let twice = ran.iter().filter(|runs| **runs > 1).count();
    let [before, after, forwarded] = [
        |p: &DroppingProxy| p.dropped_before.load(Ordering::Relaxed),
        |p: &DroppingProxy| p.dropped_after.load(Ordering::Relaxed),
        |p: &DroppingProxy| p.forwarded.load(Ordering::Relaxed),
    ]
    .map(|count| proxies.iter().map(count).sum::<usize>());
    println!(
        "{KEYS} keys, 2 callers each: {forwarded} requests answered, {before} dropped before and \
         {after} after the emulator acted; {} calls failed and were retried; keys run twice: \
         {twice}; {:?}",
        failures.load(Ordering::Relaxed),
        started.elapsed()
    );
    assert!(
        before > 0 && after > 0,
        "the proxy dropped requests both ways"
    );
    assert_eq!(twice, 0, "keys whose body ran twice: {ran:?}");
    assert!(
        ran.iter().all(|runs| *runs == 1),
        "every key's body ran: {ran:?}"
    );
    for key in 0..KEYS {
        let recorded = direct.lookup(&op.key(&key).unwrap()).await.unwrap();
        assert!(recorded.is_some(), "key {key} has its result recorded");
    }
}

/// Counted at the wire: a first execution is two requests (the claim and the completion),
/// a replay one (the claim, whose failed condition returns the record), a duplicate of a
/// running call one a poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_execution_is_two_requests_and_a_replay_one() {
    let Some(_) = dynamodb_store().await else {
        return;
    };
    let proxy = DroppingProxy::start(dynamodb_endpoint().await.unwrap(), 1, 0.0).await;
    let store = DynamoDbStore::new(dynamodb_client(&proxy.url()), DYNAMODB_TABLE);
    let op = Operation::new(namespace("dynamodb.requests"));
    let key = op.key(&1).unwrap();
    let requests = || proxy.requests("UpdateItem");
    let first = op
        .run(&store, &key, None, async { Ok::<_, Error>(1_u32) })
        .await
        .unwrap();
    assert_eq!(first, idem_runtime::Outcome::Executed(1));
    assert_eq!(requests(), 2, "a first execution: a claim and a completion");
    let replay = op
        .run(&store, &key, None, async { Ok::<_, Error>(2_u32) })
        .await
        .unwrap();
    assert_eq!(replay, idem_runtime::Outcome::Replayed(1));
    // Writes: an endpoint may also answer a failed condition without the item (the
    // conformance proxy does, one time in two), which the store then reads.
    assert_eq!(requests(), 3, "a replay: one claim");
}

/// Replies lost after their writes landed (a request that times out may still have
/// succeeded): the store reads each write back within its timeout and knows it landed, so a
/// claim is acquired, a completion recorded, and the call answered as if the replies had
/// come; nothing runs twice. A stalled table, where the read-back gets no answer either,
/// fails the operation after one timeout, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_reply_was_lost_is_read_back_and_known_to_have_landed() {
    let Some(_) = dynamodb_store().await else {
        return;
    };
    let proxy = DroppingProxy::start(dynamodb_endpoint().await.unwrap(), 1, 0.0).await;
    // The write's reply is waited for three quarters of this, its read-back the rest: well
    // over what a request takes here, on a busy machine too.
    let timeout = Duration::from_secs(4);
    let store =
        DynamoDbStore::new(dynamodb_client(&proxy.url()), DYNAMODB_TABLE).with_timeout(timeout);
    let op = Operation::new(namespace("dynamodb.late"));
    let lease = Duration::from_secs(60);

    let key = op.key(&1).unwrap();
    proxy.lose_next_landed.store(1, Ordering::SeqCst);
    let idem_runtime::Claim::Acquired { token, .. } =
        store.claim(&ClaimRequest::new(&key, lease)).await.unwrap()
    else {
        panic!("a claim that landed is acquired")
    };
    proxy.lose_next_landed.store(1, Ordering::SeqCst);
    assert!(
        store
            .complete(&key, token, "v".into(), lease)
            .await
            .unwrap(),
        "a completion that landed is recorded"
    );
    assert!(matches!(
        store.claim(&ClaimRequest::new(&key, lease)).await.unwrap(),
        idem_runtime::Claim::Completed { value, .. } if value == "v"
    ));

    // Through a call: both of its writes' replies lost, its body once, its value recorded.
    let runs = AtomicUsize::new(0);
    let key = op.key(&2).unwrap();
    proxy.lose_next_landed.store(2, Ordering::SeqCst);
    let ran = op
        .run(&store, &key, None, async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(2_u32)
        })
        .await
        .unwrap();
    assert_eq!(ran, idem_runtime::Outcome::Executed(2));
    assert_eq!(
        proxy.lose_next_landed.load(Ordering::SeqCst),
        0,
        "both replies were lost"
    );
    let again = op
        .run(&store, &key, None, async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(3_u32)
        })
        .await
        .unwrap();
    assert_eq!(again, idem_runtime::Outcome::Replayed(2));
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Stalled: the write and its read-back share the one timeout (with them in turn, it
    // took two).
    proxy.stalled.store(true, Ordering::SeqCst);
    let started = Instant::now();
    let stalled = store
        .claim(&ClaimRequest::new(&op.key(&3).unwrap(), lease))
        .await;
    assert!(matches!(stalled, Err(Error::Store(_))), "{stalled:?}");
    assert!(
        started.elapsed() < timeout * 3 / 2,
        "a stalled table answered after {:?}, its timeout {timeout:?}",
        started.elapsed()
    );
}

/// A duplicate in another process waits for a running call: its first claim is its one
/// write, and every poll after it a consistent read (a failed conditional write is billed in
/// write units by the item's size; a read in read units, by 4 KB); it replays the holder's
/// value once the holder completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_elsewhere_polls_by_reading_not_writing() {
    let Some(holder) = dynamodb_store().await else {
        return;
    };
    let proxy = DroppingProxy::start(dynamodb_endpoint().await.unwrap(), 1, 0.0).await;
    let waiter = DynamoDbStore::new(dynamodb_client(&proxy.url()), DYNAMODB_TABLE);
    let op = Operation::new(namespace("dynamodb.poll"));
    let key = op.key(&1).unwrap();
    let (started, has_started) = tokio::sync::oneshot::channel();
    let (go, wait) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn({
        let op = op.clone();
        async move {
            op.run(&holder, &key, None, async move {
                let _ = started.send(());
                let _ = wait.await;
                Ok::<_, Error>(1_u32)
            })
            .await
        }
    });
    has_started.await.unwrap();
    let waiting = tokio::spawn({
        let op = op.clone();
        async move {
            op.run(&waiter, &key, None, async { Ok::<_, Error>(2_u32) })
                .await
        }
    });
    // Until it has polled three times (each a read).
    let deadline = Instant::now() + Duration::from_secs(60);
    while proxy.requests("GetItem") < 3 {
        assert!(Instant::now() < deadline, "the duplicate polled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    go.send(()).unwrap();
    assert_eq!(
        running.await.unwrap().unwrap(),
        idem_runtime::Outcome::Executed(1)
    );
    assert_eq!(
        waiting.await.unwrap().unwrap(),
        idem_runtime::Outcome::Replayed(1)
    );
    assert_eq!(
        proxy.requests("UpdateItem"),
        1,
        "one write, the first claim; every poll a read"
    );
}

/// A table made elsewhere with another key is refused by `migrate` with a message naming
/// the key it needs; a call on it fails closed, its body not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_with_another_key_is_refused() {
    use aws_sdk_dynamodb::types::{
        AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    };

    let Some(_) = dynamodb_store().await else {
        return;
    };
    let client = dynamodb_client(&dynamodb_endpoint().await.unwrap());
    let table = "idem_tests_another_key";
    let created = client
        .create_table()
        .table_name(table)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("pk")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .unwrap(),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("pk")
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .billing_mode(BillingMode::PayPerRequest)
        .send()
        .await;
    if let Err(err) = created {
        assert!(
            err.as_service_error()
                .is_some_and(|err| err.is_resource_in_use_exception()),
            "{err:?}"
        );
    }
    let store = DynamoDbStore::new(client, table);
    let refused = store.migrate().await.unwrap_err();
    assert!(
        matches!(&refused, Error::Config(_)) && refused.to_string().contains("partition key `id`"),
        "{refused}"
    );
    let op = Operation::new(namespace("dynamodb.another_key"));
    let ran = AtomicUsize::new(0);
    let call = op
        .run(&store, &op.key(&1).unwrap(), None, async {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(1)
        })
        .await;
    assert!(matches!(call, Err(Error::Store(_))), "{call:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 0, "fail closed");
}

/// A reply lost after DynamoDB acted, and the SDK's resend of the same request: a claim
/// finds its own nonce and holds the key (another process is refused), a completion finds
/// its own write id and reports that it landed, and the record replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_write_whose_first_reply_was_lost_knows_it_landed() {
    let Some(other) = dynamodb_store().await else {
        return;
    };
    let proxy = DroppingProxy::start(dynamodb_endpoint().await.unwrap(), 1, 0.0).await;
    let store = DynamoDbStore::new(dynamodb_client(&proxy.url()), DYNAMODB_TABLE);
    let key = Operation::new(namespace("dynamodb.resent"))
        .key(&1)
        .unwrap();
    let ttl = Duration::from_secs(60);

    proxy.drop_next_after.store(1, Ordering::SeqCst);
    let idem_runtime::Claim::Acquired { token, .. } = store
        .claim(&ClaimRequest::new(&key, Duration::from_secs(60)))
        .await
        .unwrap()
    else {
        panic!("the resent claim is the caller's own")
    };
    assert_eq!(
        proxy.dropped_after.load(Ordering::SeqCst),
        1,
        "the first reply was lost"
    );
    assert_eq!(
        other
            .claim(&ClaimRequest::new(&key, Duration::from_secs(60)))
            .await
            .unwrap(),
        idem_runtime::Claim::InProgress { fingerprint: None },
        "another process finds the key held"
    );

    proxy.drop_next_after.store(1, Ordering::SeqCst);
    assert!(
        store
            .complete(&key, token, "landed".into(), ttl)
            .await
            .unwrap(),
        "the resent completion finds its own write"
    );
    assert_eq!(proxy.dropped_after.load(Ordering::SeqCst), 2);
    assert!(
        !store
            .complete(&key, token, "again".into(), ttl)
            .await
            .unwrap(),
        "a new completion of a completed key is refused"
    );
    assert!(matches!(
        other.claim(&ClaimRequest::new(&key, ttl)).await.unwrap(),
        idem_runtime::Claim::Completed { value, .. } if value == "landed"
    ));
}

/// Through an endpoint that does not return the item a failed condition found (the
/// emulator dynalite, say): the store reads it instead, keeps the whole contract, and a
/// resent completion still knows it landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_failed_conditions_item_the_store_reads_it_and_keeps_the_contract() {
    if idem_tests::dynamodb_lacks("atomic") {
        return;
    }
    let Some(_) = dynamodb_store().await else {
        return;
    };
    let proxy = DroppingProxy::start(dynamodb_endpoint().await.unwrap(), 1, 0.0).await;
    proxy.strip_failed_items.store(true, Ordering::SeqCst);
    let store = DynamoDbStore::new(dynamodb_client(&proxy.url()), DYNAMODB_TABLE);
    testkit::conformance(&store).await;

    let key = Operation::new(namespace("dynamodb.no_old_item"))
        .key(&1)
        .unwrap();
    let idem_runtime::Claim::Acquired { token, .. } = store
        .claim(&ClaimRequest::new(&key, Duration::from_secs(60)))
        .await
        .unwrap()
    else {
        panic!("a fresh key is free")
    };
    proxy.drop_next_after.store(1, Ordering::SeqCst);
    let ttl = Duration::from_secs(60);
    assert!(
        store
            .complete(&key, token, "landed".into(), ttl)
            .await
            .unwrap(),
        "the resent completion reads the item and finds its own write"
    );
    let before = (proxy.requests("UpdateItem"), proxy.requests("GetItem"));
    assert!(matches!(
        store.claim(&ClaimRequest::new(&key, ttl)).await.unwrap(),
        idem_runtime::Claim::Completed { value, .. } if value == "landed"
    ));
    assert_eq!(
        (
            proxy.requests("UpdateItem") - before.0,
            proxy.requests("GetItem") - before.1
        ),
        (1, 1),
        "a replay costs the failed claim and the read"
    );
}

/// A 500 KiB result, more than a DynamoDB item holds: the body runs once, its caller gets
/// its value (its completion is not sent again and again), and a retry from another
/// process's store gets `Gone`, its body not run. A result of exactly
/// `MAX_RESULT_BYTES` encoded is recorded and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_larger_than_an_item_holds_runs_once_and_its_retries_get_gone() {
    let Some(first) = dynamodb_store().await else {
        return;
    };
    let url = dynamodb_endpoint().await.unwrap();
    // Another process's, in effect: a registry of its own.
    let second = DynamoDbStore::new(dynamodb_client(&url), DYNAMODB_TABLE);
    let op = Operation::new(namespace("dynamodb.oversize"));
    let runs = AtomicUsize::new(0);
    // Counted when the body runs, not when its future is made.
    let body = |value: String| {
        let runs = &runs;
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(value)
        }
    };

    let big = op.key(&"big").unwrap();
    let huge = "x".repeat(500 * 1024);
    let ran = op
        .run(&first, &big, None, body(huge.clone()))
        .await
        .unwrap();
    assert_eq!(ran, idem_runtime::Outcome::Executed(huge));
    let retried = op.run(&second, &big, None, body(String::new())).await;
    assert!(matches!(retried, Err(Error::Gone)), "{retried:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
    // Recorded as gone: a record of one byte, which every version replays as `Gone`.
    let recorded = item(&url, &big).await;
    assert_eq!(text(&recorded, "state"), "COMPLETED");
    assert!(
        matches!(recorded.get("value"), Some(AttributeValue::B(value)) if value.as_ref() == b"g"),
        "{:?}",
        recorded.get("value").map(|_| "a value of another size")
    );

    // The largest result kept: a JSON string's encoding is a tag, two quotes and its text.
    let fits = op.key(&"fits").unwrap();
    let largest = "y".repeat(idem_runtime::store::dynamodb::MAX_RESULT_BYTES - 3);
    let ran = op
        .run(&first, &fits, None, body(largest.clone()))
        .await
        .unwrap();
    assert_eq!(ran, idem_runtime::Outcome::Executed(largest.clone()));
    let replayed = op
        .run(&second, &fits, None, body(String::new()))
        .await
        .unwrap();
    assert_eq!(replayed, idem_runtime::Outcome::Replayed(largest));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Tokens only grow: across a removal (its tombstone keeps the token) and across the
/// deletion of the item by DynamoDB's TTL (the next claim starts from its clock in
/// microseconds). A completion drops the call's steps; a step past DynamoDB's 400 KB item
/// limit fails with `Error::Store`, recording nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_grow_across_removals_and_deletions_and_steps_end_with_their_call() {
    if idem_tests::dynamodb_lacks("atomic") {
        return;
    }
    let Some(store) = dynamodb_store().await else {
        return;
    };
    let url = dynamodb_endpoint().await.unwrap();
    let op = Operation::new(namespace("dynamodb.tokens"));
    let key = op.key(&1).unwrap();
    let held = Duration::from_secs(60);
    let claim = || async {
        match store.claim(&ClaimRequest::new(&key, held)).await.unwrap() {
            idem_runtime::Claim::Acquired { token, .. } => token,
            other => panic!("the key is free: {other:?}"),
        }
    };
    let first = claim().await;
    let step = op.key(&"step").unwrap();
    assert!(store
        .record_step(&key, first, &step, "one".into(), held)
        .await
        .unwrap());
    let too_big = bytes::Bytes::from(vec![b'x'; 450 * 1024]);
    let refused = store.record_step(&key, first, &step, too_big, held).await;
    assert!(matches!(refused, Err(Error::Store(_))), "{refused:?}");
    assert_eq!(
        store.steps(&key).await.unwrap().len(),
        1,
        "the big step recorded nothing"
    );
    assert!(store.complete(&key, first, "v".into(), held).await.unwrap());
    assert_eq!(
        item(&url, &key).await.get("steps"),
        None,
        "a completion drops the steps"
    );

    assert!(store.remove(&key).await.unwrap());
    let after_removal = claim().await;
    assert!(after_removal > first, "{after_removal:?} after {first:?}");

    // What DynamoDB's TTL does to an expired item, days later.
    dynamodb_client(&url)
        .delete_item()
        .table_name(DYNAMODB_TABLE)
        .key("id", AttributeValue::S(key.to_hex()))
        .send()
        .await
        .unwrap();
    let after_deletion = claim().await;
    assert!(
        after_deletion > after_removal,
        "{after_deletion:?} after {after_removal:?}"
    );
}

/// `migrate` from several processes at once on a new table: every one succeeds, and the
/// table works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_at_once_all_succeed() {
    let Some(_) = dynamodb_store().await else {
        return;
    };
    let url = dynamodb_endpoint().await.unwrap();
    let table = namespace("idem_tests_migrate").replace('.', "_");
    let stores: Vec<_> = (0..4)
        .map(|_| DynamoDbStore::new(dynamodb_client(&url), table.as_str()))
        .collect();
    let migrations = stores.iter().map(|store| store.migrate());
    for migrated in futures_util::future::join_all(migrations).await {
        migrated.unwrap();
    }
    let op = Operation::new(namespace("dynamodb.migrated"));
    let out = op
        .run(&stores[0], &op.key(&1).unwrap(), None, async {
            Ok::<_, Error>(1)
        })
        .await
        .unwrap();
    assert_eq!(out, idem_runtime::Outcome::Executed(1));
    dynamodb_client(&url)
        .delete_table()
        .table_name(&table)
        .send()
        .await
        .unwrap();
}

/// Under `IDEM_DYNAMODB_CONFORMANCE=1` (as `.ci/run` runs this suite a second time): the
/// proxy answers as AWS may and the emulator does not, and the store keeps its contract
/// through each deviation. A claim taken over or sent again sets `lease_ms` to the value it
/// had, which the proxy leaves out of `UPDATED_NEW`: the claim still holds its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_conformance_proxy_every_deviation_is_answered() {
    use std::sync::atomic::Ordering::Relaxed;

    let Some(store) = dynamodb_store().await else {
        return;
    };
    let Some((_, done)) = idem_tests::dynamodb_conformance_proxy("") else {
        eprintln!("skipped: IDEM_DYNAMODB_CONFORMANCE is not set");
        return;
    };
    let op = Operation::new(namespace("dynamodb.conformance"));
    let lease = Duration::from_secs(60);
    // A claim sent again with its nonce (its reply lost) takes the item again under the
    // same lease: `lease_ms` unchanged. 100 keys at once.
    let calls = (0..100_u32).map(|n| {
        let (store, key) = (store.clone(), op.key(&n).unwrap());
        async move {
            let first = store
                .claim(&ClaimRequest::new(&key, lease).nonce(7))
                .await
                .unwrap();
            let again = store
                .claim(&ClaimRequest::new(&key, lease).nonce(7))
                .await
                .unwrap();
            let (
                idem_runtime::Claim::Acquired { token: first, .. },
                idem_runtime::Claim::Acquired { token: again, .. },
            ) = (first, again)
            else {
                panic!("a claim sent again with its nonce is its own");
            };
            assert!(again > first);
            assert!(store
                .complete(&key, again, "v".into(), lease)
                .await
                .unwrap());
            // Replays: failed conditions, some answered without the item.
            for _ in 0..4 {
                assert!(matches!(
                    store.claim(&ClaimRequest::new(&key, lease)).await.unwrap(),
                    idem_runtime::Claim::Completed { value, .. } if value == "v"
                ));
            }
        }
    });
    futures_util::future::join_all(calls).await;
    let count = |counter: &AtomicUsize| counter.load(Relaxed);
    println!("the conformance proxy: {done:?}");
    assert!(count(&done.unchanged_dropped) > 0, "{done:?}");
    assert!(count(&done.items_omitted) > 0, "{done:?}");
    assert!(count(&done.throttled) > 0, "{done:?}");
}

/// An item's size by DynamoDB's published rules: its attributes' names and values, a
/// string and a binary by their bytes, a number by (significant digits / 2) + 1, a null 1,
/// a map 3 plus each entry's name, value and 1.
fn item_size(item: &std::collections::HashMap<String, AttributeValue>) -> usize {
    fn value(attribute: &AttributeValue) -> usize {
        match attribute {
            AttributeValue::S(text) => text.len(),
            AttributeValue::B(blob) => blob.as_ref().len(),
            AttributeValue::N(number) => {
                let digits = number.trim_start_matches('-').replace('.', "");
                let significant = digits.trim_start_matches('0').trim_end_matches('0');
                significant.len().max(1).div_ceil(2) + 1
            }
            AttributeValue::Null(_) | AttributeValue::Bool(_) => 1,
            AttributeValue::M(map) => {
                3 + map
                    .iter()
                    .map(|(name, entry)| name.len() + value(entry) + 1)
                    .sum::<usize>()
            }
            other => panic!("no sizing rule here for {other:?}"),
        }
    }
    item.iter().map(|(name, v)| name.len() + value(v)).sum()
}

/// The units DynamoDB reports (`ReturnConsumedCapacity`, which the emulator answers for
/// writes that land and for reads) are the ones the stores guide computes from AWS's rules:
/// a write by the larger of the item before and after it in 1 KB units, a consistent read
/// in 4 KB units. For a first execution of a small result, of a 10 KB one, a step and a
/// waiter's read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_consumed_are_the_rules_computed() {
    if idem_tests::dynamodb_lacks("capacity") {
        return;
    }
    let Some(_) = dynamodb_store().await else {
        return;
    };
    let url = dynamodb_endpoint().await.unwrap();
    let proxy = DroppingProxy::start(url.clone(), 1, 0.0).await;
    proxy.capacity.store(true, Ordering::SeqCst);
    let store = DynamoDbStore::new(dynamodb_client(&proxy.url()), DYNAMODB_TABLE);
    let op = Operation::new(namespace("dynamodb.units"));
    let units = |bytes: usize, unit: usize| bytes.div_ceil(unit).max(1) as f64;
    let consumed = || std::mem::take(&mut *proxy.consumed.lock().unwrap());

    for (n, result) in [(1_u32, "r".to_string()), (2, "r".repeat(10 * 1024))] {
        let key = op.key(&n).unwrap();
        let idem_runtime::Claim::Acquired { token, .. } = store
            .claim(&ClaimRequest::new(&key, Duration::from_secs(60)))
            .await
            .unwrap()
        else {
            panic!("a fresh key is free")
        };
        let held = item_size(&item(&url, &key).await);
        assert!(held < 1024, "a claim in progress is {held} bytes");
        let step = op.key(&"step").unwrap();
        assert!(store
            .record_step(
                &key,
                token,
                &step,
                "s".repeat(2_000).into(),
                Duration::from_secs(60)
            )
            .await
            .unwrap());
        let with_step = item_size(&item(&url, &key).await);
        let encoded = serde_json::to_vec(&result).unwrap();
        assert!(store
            .complete(&key, token, encoded.into(), Duration::from_secs(60))
            .await
            .unwrap());
        let completed = item_size(&item(&url, &key).await);
        // A waiter's read of a completed item.
        let _ = store.lookup(&key).await.unwrap();
        assert_eq!(
            consumed(),
            [
                ("UpdateItem".to_string(), units(held, 1024)),
                ("UpdateItem".to_string(), units(with_step, 1024)),
                (
                    "UpdateItem".to_string(),
                    units(with_step.max(completed), 1024)
                ),
                ("GetItem".to_string(), units(completed, 4096)),
            ],
            "claim ({held} B), step (to {with_step} B), completion (to {completed} B), read"
        );
    }
}
