//! The kinds of function the attribute supports, and what its expansion must survive.

use super::*;

// --- free functions -------------------------------------------------------------------

static FREE_RUNS: std::sync::LazyLock<Runs> = std::sync::LazyLock::new(Runs::default);

/// Doc comments and attributes are kept.
#[idempotent(key = id)]
#[inline]
pub(crate) async fn free_function(id: u64) -> Result<usize, AppError> {
    Ok(FREE_RUNS.hit())
}

#[tokio::test]
async fn a_free_function_on_the_default_store_runs_once_per_key() {
    let first = free_function(1).await.unwrap();
    assert_eq!(free_function(1).await.unwrap(), first);
    assert_ne!(free_function(2).await.unwrap(), first);
    assert_eq!(FREE_RUNS.count(), 2);
}

#[idempotent(key = req.id, store = store, ignore = runs)]
async fn moves_its_argument(
    store: &MemoryStore,
    req: Request,
    runs: &Runs,
) -> Result<String, AppError> {
    runs.hit();
    let owned: Request = req; // the body moves `req`; the key was derived before
    Ok(owned.note)
}

#[tokio::test]
async fn the_key_is_derived_before_the_body_moves_the_argument() {
    let (store, runs) = (store(), Runs::default());
    let req = |note: &str| Request {
        id: 7,
        amount: 1,
        note: note.into(),
    };
    assert_eq!(
        moves_its_argument(&store, req("first"), &runs)
            .await
            .unwrap(),
        "first"
    );
    assert_eq!(
        moves_its_argument(&store, req("second"), &runs)
            .await
            .unwrap(),
        "first"
    );
    assert_eq!(runs.count(), 1);
}

#[idempotent(key = (a, b), store = store, ignore = runs)]
async fn with_lifetimes<'a, 'b>(
    store: &MemoryStore,
    a: &'a str,
    b: &'b str,
    runs: &Runs,
) -> Result<String, AppError>
where
    'b: 'a,
{
    runs.hit();
    Ok(format!("{a}{b}"))
}

#[tokio::test]
async fn reference_parameters_and_explicit_lifetimes() {
    let (store, runs) = (store(), Runs::default());
    assert_eq!(
        with_lifetimes(&store, "ab", "c", &runs).await.unwrap(),
        "abc"
    );
    assert_eq!(
        with_lifetimes(&store, "a", "bc", &runs).await.unwrap(),
        "abc"
    );
    assert_eq!(
        runs.count(),
        2,
        "(\"ab\", \"c\") and (\"a\", \"bc\") are different keys"
    );
}

#[idempotent(key = item.to_string(), store = store, ignore = runs)]
async fn generic<T, S>(store: &S, item: T, runs: &Runs) -> Result<String, AppError>
where
    T: std::fmt::Display + Send,
    S: idem_runtime::Store + Clone,
{
    runs.hit();
    Ok(format!("<{item}>"))
}

#[tokio::test]
async fn generic_functions_with_where_clauses() {
    let (store, runs) = (store(), Runs::default());
    assert_eq!(generic(&store, 5_u8, &runs).await.unwrap(), "<5>");
    assert_eq!(generic(&store, "5", &runs).await.unwrap(), "<5>");
    assert_eq!(runs.count(), 1);
    let shared: Arc<dyn idem_runtime::Store> = Arc::new(store.clone());
    assert_eq!(
        generic(&shared, 5_u8, &runs).await.unwrap(),
        "<5>",
        "Arc<dyn Store> sees the same records"
    );
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn functions_nested_in_functions() {
    #[idempotent(key = n, store = store, ignore = runs)]
    async fn nested(store: &MemoryStore, n: u8, runs: &Runs) -> Result<u8, AppError> {
        runs.hit();
        Ok(n * 2)
    }
    let (store, runs) = (store(), Runs::default());
    assert_eq!(nested(&store, 4, &runs).await.unwrap(), 8);
    assert_eq!(nested(&store, 4, &runs).await.unwrap(), 8);
    assert_eq!(runs.count(), 1);
}

// --- methods --------------------------------------------------------------------------

struct Payments {
    store: MemoryStore,
    runs: Runs,
    charged: u64,
}

impl Payments {
    #[idempotent(key = req.id, store = self.store, namespace = "payments.charge.v1", fingerprint = (req.amount, &req.note))]
    async fn charge(&self, req: &Request) -> Result<u64, AppError> {
        self.runs.hit();
        Ok(req.amount)
    }

    #[idempotent(key = id, store = self.store, namespace = "payments.record.v1", fingerprint = cents)]
    async fn record(&mut self, id: u64, cents: u64) -> Result<u64, AppError> {
        self.charged += cents;
        Ok(self.charged)
    }

    #[idempotent(key = id, store = self.store.clone(), namespace = "payments.consume.v1")]
    async fn consume(self: Arc<Self>, id: u64) -> Result<u64, AppError> {
        Ok(id + self.charged)
    }
}

#[tokio::test]
async fn methods_with_self_and_a_fingerprint() {
    let payments = Payments {
        store: store(),
        runs: Runs::default(),
        charged: 0,
    };
    let req = Request {
        id: 1,
        amount: 500,
        note: "coffee".into(),
    };
    assert_eq!(payments.charge(&req).await.unwrap(), 500);
    assert_eq!(payments.charge(&req).await.unwrap(), 500);
    assert_eq!(payments.runs.count(), 1);

    let tampered = Request {
        amount: 900,
        ..req.clone()
    };
    assert_eq!(
        payments.charge(&tampered).await,
        Err(AppError::Idem("mismatch".into()))
    );
    assert_eq!(payments.runs.count(), 1, "a mismatch never runs the body");
}

#[tokio::test]
async fn methods_with_mut_self_and_self_arc() {
    let mut payments = Payments {
        store: store(),
        runs: Runs::default(),
        charged: 0,
    };
    assert_eq!(payments.record(1, 100).await.unwrap(), 100);
    assert_eq!(payments.record(1, 100).await.unwrap(), 100);
    assert_eq!(payments.record(2, 50).await.unwrap(), 150);
    assert_eq!(payments.charged, 150);
    let shared = Arc::new(payments);
    assert_eq!(shared.clone().consume(1).await.unwrap(), 151);
}

// --- namespaces -----------------------------------------------------------------------

mod billing {
    use super::*;
    #[idempotent(key = id, store = store)]
    pub async fn same_name(store: &MemoryStore, id: u8) -> Result<String, AppError> {
        let _ = id;
        Ok("billing".into())
    }
    #[idempotent(key = id, store = store, namespace = "shared.op")]
    pub async fn explicit(store: &MemoryStore, id: u8) -> Result<String, AppError> {
        let _ = id;
        Ok("billing".into())
    }
}

mod shipping {
    use super::*;
    #[idempotent(key = id, store = store)]
    pub async fn same_name(store: &MemoryStore, id: u8) -> Result<String, AppError> {
        let _ = id;
        Ok("shipping".into())
    }
    #[idempotent(key = id, store = store, namespace = "shared.op")]
    pub async fn explicit(store: &MemoryStore, id: u8) -> Result<String, AppError> {
        let _ = id;
        Ok("shipping".into())
    }
}

#[tokio::test]
async fn same_named_functions_in_different_modules_never_share_keys_but_a_namespace_does() {
    let store = store();
    assert_eq!(billing::same_name(&store, 1).await.unwrap(), "billing");
    assert_eq!(shipping::same_name(&store, 1).await.unwrap(), "shipping");
    assert_eq!(billing::explicit(&store, 1).await.unwrap(), "billing");
    assert_eq!(
        shipping::explicit(&store, 1).await.unwrap(),
        "billing",
        "one namespace, one operation"
    );
}

#[idempotent(key = id, store = store)]
async fn uses_question_mark(store: &MemoryStore, id: &str) -> Result<u64, AppError> {
    let parsed: u64 = id.parse().map_err(|_| AppError::Flaky)?;
    if parsed == 0 {
        return Err(AppError::Declined("zero".into()));
    }
    Ok(parsed)
}

#[idempotent(key = id, store = store)]
async fn with_inner_attribute(store: &MemoryStore, id: u8) -> Result<u8, AppError> {
    #![allow(unused_variables)]
    let unused = 1;
    Ok(id)
}

#[tokio::test]
async fn inner_attributes_stay_inside_the_function() {
    assert_eq!(with_inner_attribute(&store(), 3).await, Ok(3));
}

#[tokio::test]
async fn question_mark_and_early_return_work_in_the_body() {
    let store = store();
    assert_eq!(uses_question_mark(&store, "12").await, Ok(12));
    assert_eq!(uses_question_mark(&store, "x").await, Err(AppError::Flaky));
    assert_eq!(
        uses_question_mark(&store, "0").await,
        Err(AppError::Declined("zero".into()))
    );
}

// Parameters named like the macro's own arguments and internals.
#[idempotent(key = key, store = store, fingerprint = fingerprint, ignore = __idem_op)]
async fn named_like_internals(
    store: &MemoryStore,
    key: u8,
    fingerprint: u8,
    __idem_op: u8,
) -> Result<u8, AppError> {
    Ok(key + fingerprint + __idem_op)
}

#[tokio::test]
async fn parameters_named_key_store_or_like_generated_locals_do_not_collide() {
    let store = store();
    assert_eq!(named_like_internals(&store, 1, 2, 3).await, Ok(6));
    assert_eq!(
        named_like_internals(&store, 1, 2, 9).await,
        Ok(6),
        "replayed"
    );
    assert_eq!(
        named_like_internals(&store, 1, 5, 3).await,
        Err(AppError::Idem("mismatch".into()))
    );
}

#[idempotent(key = f64::NAN, store = store)]
async fn nan_key(store: &MemoryStore) -> Result<u8, AppError> {
    Ok(1)
}

#[tokio::test]
async fn a_key_that_cannot_be_encoded_is_a_key_error_not_a_panic() {
    let err = nan_key(&store()).await.unwrap_err();
    assert!(
        matches!(&err, AppError::Idem(m) if m.contains("NaN")),
        "{err:?}"
    );
}

mod reexport {
    pub use idem_runtime as idem;
}

#[idempotent(key = id, store = store, crate = "reexport::idem")]
async fn through_a_reexport(store: &MemoryStore, id: u8) -> Result<u8, AppError> {
    Ok(id)
}

#[tokio::test]
async fn crate_points_at_a_reexport() {
    assert_eq!(through_a_reexport(&store(), 4).await, Ok(4));
}

// --- the future is Send whenever the body's is ----------------------------------------

fn assert_send<F: std::future::Future + Send>(f: F) -> F {
    f
}

#[tokio::test]
async fn the_generated_future_is_send() {
    let store = store();
    let payments = Payments {
        store: store.clone(),
        runs: Runs::default(),
        charged: 0,
    };
    let req = Request {
        id: 1,
        amount: 1,
        note: String::new(),
    };
    assert_send(payments.charge(&req)).await.unwrap();
    assert_send(free_function(99)).await.unwrap();
    assert_send(generic(&store, 1_u8, &Runs::default()))
        .await
        .unwrap();
    // And it can be spawned on a multi-threaded runtime.
    let handle = tokio::spawn(async move { free_function(100).await });
    handle.await.unwrap().unwrap();
}

#[tokio::test]
async fn fingerprint_values_match_the_runtime_api() {
    // The macro's fingerprint is the runtime's: a record made by one is checked by the other.
    let store = store();
    let op = idem_runtime::Operation::new("payments.charge.v1");
    let req = Request {
        id: 42,
        amount: 5,
        note: "n".into(),
    };
    let key = op.key(&req.id).unwrap();
    let fp = Fingerprint::of(&(req.amount, &req.note)).unwrap();
    let recorded = op
        .run(&store, &key, Some(&fp), async { Ok::<_, Error>(5_u64) })
        .await
        .unwrap();
    assert!(!recorded.is_replayed());
    let payments = Payments {
        store,
        runs: Runs::default(),
        charged: 0,
    };
    assert_eq!(payments.charge(&req).await, Ok(5));
    assert_eq!(
        payments.runs.count(),
        0,
        "replayed the record made through the runtime API"
    );
}

/// A success type that names a lifetime is replayed by decoding (it cannot be kept beside the
/// record as itself); it compiles and replays like any other.
#[idempotent(key = id, store = store, namespace = "attribute.borrowed")]
async fn borrowed<'a>(store: &'a MemoryStore, id: u64) -> Result<std::borrow::Cow<'a, str>, Error> {
    Ok(std::borrow::Cow::Owned(format!("receipt {id}")))
}

#[idempotent(key = id, store = store, namespace = "attribute.static_cow")]
async fn static_cow(store: &MemoryStore, id: u64) -> Result<std::borrow::Cow<'static, str>, Error> {
    Ok(std::borrow::Cow::Owned(format!("receipt {id}")))
}

#[tokio::test]
async fn success_types_with_lifetimes_compile_and_replay() {
    let store = MemoryStore::new();
    assert_eq!(borrowed(&store, 1).await.unwrap(), "receipt 1");
    assert_eq!(borrowed(&store, 1).await.unwrap(), "receipt 1");
    assert_eq!(static_cow(&store, 2).await.unwrap(), "receipt 2");
    assert_eq!(static_cow(&store, 2).await.unwrap(), "receipt 2");
}

// --- the `_outcome` sibling ------------------------------------------------------------

use idem_runtime::Outcome;

/// A free function with a pattern parameter and a generic one: its sibling answers
/// executed or replayed, and shares its keys.
#[idempotent(key = (id, label.to_string()), store = store, ignore = runs)]
async fn siblings<T: std::fmt::Display>(
    store: &MemoryStore,
    (id, _): (u64, u8),
    label: T,
    runs: &Runs,
) -> Result<String, AppError> {
    runs.hit();
    Ok(format!("{id}:{label}"))
}

impl Payments {
    /// An associated function without `self` whose signature names `Self`.
    #[idempotent(key = id, store = store, namespace = "payments.open.v1")]
    async fn open(store: &MemoryStore, id: u64) -> Result<u64, AppError>
    where
        Self: Sized,
    {
        Ok(id)
    }
}

#[tokio::test]
async fn every_function_has_an_outcome_sibling_that_shares_its_keys() {
    let (store, runs) = (store(), Runs::default());
    let first = siblings_outcome(&store, (7, 0), "x", &runs).await.unwrap();
    assert_eq!(first, Outcome::Executed("7:x".to_string()));
    assert_eq!(siblings(&store, (7, 1), "x", &runs).await.unwrap(), "7:x");
    let again = siblings_outcome(&store, (7, 2), "x", &runs).await.unwrap();
    assert_eq!(again, Outcome::Replayed("7:x".to_string()));
    assert_eq!(runs.count(), 1);

    let payments = Payments {
        store: store.clone(),
        runs: Runs::default(),
        charged: 0,
    };
    let req = Request {
        id: 3,
        amount: 70,
        note: "tea".into(),
    };
    assert_eq!(
        payments.charge_outcome(&req).await.unwrap(),
        Outcome::Executed(70)
    );
    assert_eq!(payments.charge(&req).await.unwrap(), 70);
    assert_eq!(
        payments.charge_outcome(&req).await.unwrap(),
        Outcome::Replayed(70)
    );
    assert_eq!(
        Payments::open_outcome(&store, 1).await.unwrap(),
        Outcome::Executed(1)
    );
    assert_eq!(Payments::open(&store, 1).await.unwrap(), 1);
}
