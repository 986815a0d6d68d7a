//! The attribute's policies: `cache_err`, optional keys, `in_flight`, `ttl`, `on_cancel`.

use super::*;

// --- policies -------------------------------------------------------------------------

fn is_declined(e: &AppError) -> bool {
    matches!(e, AppError::Declined(_))
}

#[idempotent(key = id, store = store, cache_err = is_declined, ignore = (outcome, runs))]
async fn may_decline(
    store: &MemoryStore,
    id: u8,
    outcome: Result<u8, AppError>,
    runs: &Runs,
) -> Result<u8, AppError> {
    runs.hit();
    outcome
}

#[tokio::test]
async fn cache_err_records_final_errors_and_releases_others() {
    let (store, runs) = (store(), Runs::default());
    let declined = || Err(AppError::Declined("card".into()));
    assert_eq!(may_decline(&store, 1, declined(), &runs).await, declined());
    assert_eq!(may_decline(&store, 1, Ok(1), &runs).await, declined());
    assert_eq!(runs.count(), 1);
    assert_eq!(
        may_decline(&store, 2, Err(AppError::Flaky), &runs).await,
        Err(AppError::Flaky)
    );
    assert_eq!(may_decline(&store, 2, Ok(2), &runs).await, Ok(2));
    assert_eq!(runs.count(), 3);
}

/// An error type that holds the runtime's own error, and derives both serde traits as
/// `cache_err` needs: `idem_runtime::Error` is `Serialize + Deserialize`.
#[derive(Debug, Serialize, Deserialize)]
enum ChargeError {
    Declined(String),
    Idem(Error),
}

impl From<Error> for ChargeError {
    fn from(err: Error) -> Self {
        Self::Idem(err)
    }
}

fn is_final(err: &ChargeError) -> bool {
    matches!(err, ChargeError::Declined(_))
}

#[idempotent(key = id, store = store, cache_err = is_final, ignore = runs)]
async fn charge_or_decline(store: &MemoryStore, id: u8, runs: &Runs) -> Result<u8, ChargeError> {
    runs.hit();
    Err(ChargeError::Declined(format!("card {id}")))
}

#[tokio::test]
async fn cache_err_takes_an_error_type_that_holds_idem_runtime_error() {
    let (store, runs) = (store(), Runs::default());
    for _ in 0..2 {
        let declined = charge_or_decline(&store, 7, &runs).await;
        assert!(matches!(declined, Err(ChargeError::Declined(ref why)) if why == "card 7"));
    }
    assert_eq!(runs.count(), 1, "the declined charge was not replayed");
}

// --- optional keys --------------------------------------------------------------------

#[idempotent(key = key, store = store, namespace = "optional.owned", ignore = runs)]
async fn maybe_keyed(
    store: &Probe<MemoryStore>,
    key: Option<String>,
    runs: &Runs,
) -> Result<usize, AppError> {
    Ok(runs.hit())
}

#[idempotent(key = message.key, store = store, namespace = "optional.field", ignore = runs)]
async fn maybe_keyed_message(
    store: &MemoryStore,
    message: &Message,
    runs: &Runs,
) -> Result<usize, AppError> {
    Ok(runs.hit())
}

#[idempotent(key = key, store = store, namespace = "optional.borrowed", ignore = runs)]
async fn maybe_keyed_by_reference(
    store: &MemoryStore,
    key: &Option<u64>,
    runs: &Runs,
) -> Result<usize, AppError> {
    Ok(runs.hit())
}

#[idempotent(key = (tenant, key), store = store, namespace = "optional.in_a_tuple", ignore = runs)]
async fn option_in_a_tuple(
    store: &MemoryStore,
    tenant: u8,
    key: Option<u64>,
    runs: &Runs,
) -> Result<usize, AppError> {
    Ok(runs.hit())
}

struct Message {
    key: Option<String>,
}

#[tokio::test]
async fn an_absent_optional_key_runs_the_body_without_a_claim() {
    let (store, runs) = (Probe::new(self::store()), Runs::default());
    // `None`: every call runs, and nothing is claimed or recorded.
    assert_eq!(maybe_keyed(&store, None, &runs).await, Ok(0));
    assert_eq!(maybe_keyed(&store, None, &runs).await, Ok(1));
    assert_eq!(store.claims(), 0, "an unkeyed call claimed a key");
    // `Some`: keyed as usual.
    let key = || Some("k1".to_string());
    assert_eq!(maybe_keyed(&store, key(), &runs).await, Ok(2));
    assert_eq!(maybe_keyed(&store, key(), &runs).await, Ok(2));
    assert_eq!(runs.count(), 3);

    // Through a field, and through a reference.
    let (store, runs) = (self::store(), Runs::default());
    let unkeyed = Message { key: None };
    assert_eq!(maybe_keyed_message(&store, &unkeyed, &runs).await, Ok(0));
    assert_eq!(maybe_keyed_message(&store, &unkeyed, &runs).await, Ok(1));
    let keyed = Message {
        key: Some("m1".into()),
    };
    assert_eq!(maybe_keyed_message(&store, &keyed, &runs).await, Ok(2));
    assert_eq!(maybe_keyed_message(&store, &keyed, &runs).await, Ok(2));
    assert_eq!(maybe_keyed_by_reference(&store, &None, &runs).await, Ok(3));
    assert_eq!(maybe_keyed_by_reference(&store, &None, &runs).await, Ok(4));
    assert_eq!(
        maybe_keyed_by_reference(&store, &Some(9), &runs).await,
        Ok(5)
    );
    assert_eq!(
        maybe_keyed_by_reference(&store, &Some(9), &runs).await,
        Ok(5)
    );
}

#[tokio::test]
async fn an_option_inside_a_tuple_is_part_of_a_key_that_is_always_there() {
    let (store, runs) = (store(), Runs::default());
    assert_eq!(option_in_a_tuple(&store, 1, None, &runs).await, Ok(0));
    assert_eq!(option_in_a_tuple(&store, 1, None, &runs).await, Ok(0));
    assert_eq!(option_in_a_tuple(&store, 1, Some(2), &runs).await, Ok(1));
    assert_eq!(runs.count(), 2);
}

#[tokio::test]
async fn a_present_optional_key_is_the_key_it_was_before_optional_keys() {
    // Records written when an `Option` key was an ordinary value still replay.
    let store = Probe::new(self::store());
    let operation = idem_runtime::Operation::new("optional.owned");
    let key = operation.key(&Some("old".to_string())).unwrap();
    let first = operation
        .run(&store, &key, None, async { Ok::<_, Error>(41_usize) })
        .await
        .unwrap();
    assert!(!first.is_replayed());
    let runs = Runs::default();
    assert_eq!(maybe_keyed(&store, Some("old".into()), &runs).await, Ok(41));
    assert_eq!(runs.count(), 0);
}

#[idempotent(key = id, store = store, in_flight = "reject", lease = Duration::from_secs(5), ttl = "1h30m")]
async fn slow_reject(store: &MemoryStore, id: u8) -> Result<u8, AppError> {
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(id)
}

// Paused time: the second call starts 20 ms into the first one's 100 ms on tokio's clock,
// however busy the machine is.
#[tokio::test(start_paused = true)]
async fn in_flight_reject_fails_fast_while_the_first_call_runs() {
    let store = store();
    let (first, second) = tokio::join!(slow_reject(&store, 1), async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        slow_reject(&store, 1).await
    });
    assert_eq!(first, Ok(1));
    assert_eq!(second, Err(AppError::Idem("in progress".into())));
}

#[idempotent(
    key = id,
    store = store,
    ttl = Duration::from_secs(60 * 60),
    ignore = runs,
    namespace = "tests.attribute.an_hour"
)]
async fn an_hour(
    store: &idem_runtime::SqliteStore,
    id: u8,
    runs: &Runs,
) -> Result<usize, AppError> {
    let _ = id;
    Ok(runs.hit())
}

/// The record lives for the expression's hour, not the default day: read from a store
/// that tells how long a record has left (SQLite, by its clock).
#[tokio::test]
async fn ttl_accepts_a_duration_expression() {
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("attribute-ttl-{}.db", std::process::id()));
    let store = idem_runtime::SqliteStore::open(&path).await.unwrap();
    store.migrate().await.unwrap();
    let runs = Runs::default();
    assert_eq!(an_hour(&store, 1, &runs).await, Ok(0));
    assert_eq!(an_hour(&store, 1, &runs).await, Ok(0), "replayed");
    let key = idem_runtime::Operation::new("tests.attribute.an_hour")
        .key(&1_u8)
        .unwrap();
    let recorded = idem_runtime::Store::lookup(&store, &key).await.unwrap();
    let left = recorded.and_then(|recorded| recorded.expires_in);
    assert!(
        left.is_some_and(
            |left| left > Duration::from_secs(59 * 60) && left <= Duration::from_secs(60 * 60)
        ),
        "the record lives for an hour: {left:?}"
    );
    drop(store);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

#[idempotent(key = id, store = store, on_cancel = "complete", ignore = runs)]
async fn completes_in_background(store: MemoryStore, id: u8, runs: Runs) -> Result<u8, AppError> {
    runs.hit();
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_cancel_complete_finishes_the_body_after_the_caller_is_gone() {
    let (store, runs) = (store(), Runs::default());
    let call = tokio::spawn(completes_in_background(store.clone(), 3, runs.clone()));
    // Cancelled once its body runs, however busy the machine is.
    while runs.count() == 0 {
        tokio::task::yield_now().await;
    }
    call.abort();
    // The body still runs in the background: this call waits for it and replays it.
    assert_eq!(completes_in_background(store, 3, runs.clone()).await, Ok(3));
    assert_eq!(
        runs.count(),
        1,
        "the second call replayed the background result"
    );
}

// --- label ----------------------------------------------------------------------------

#[idempotent(
    key = order.id,
    store = store,
    namespace = "attribute.labelled",
    label = format!("order {}", order.id),
    ignore = seen
)]
async fn labelled_charge(
    store: &MemoryStore,
    order: Request,
    seen: &std::sync::Mutex<Option<Option<String>>>,
) -> Result<u64, AppError> {
    use idem_runtime::admin::Admin;
    // The claim, as an operator's listing shows it while the body runs.
    let key = idem_runtime::Key::derive("attribute.labelled", &order.id).unwrap();
    let entry = store.inspect(&key).await.unwrap().expect("held");
    *seen.lock().unwrap() = Some(entry.label().map(str::to_owned));
    // The body may move what the label was made of: it was owned before the body ran.
    let Request { amount, .. } = order;
    Ok(amount)
}

#[tokio::test]
async fn a_label_names_the_claim_in_an_operators_listing() {
    let store = store();
    let seen = std::sync::Mutex::new(None);
    let order = Request {
        id: 17,
        amount: 250,
        note: String::new(),
    };
    assert_eq!(labelled_charge(&store, order, &seen).await, Ok(250));
    assert_eq!(
        seen.lock().unwrap().take(),
        Some(Some("order 17".to_string()))
    );
}
