//! A replay from the memory store, or from a memory tier's copy of a result completed in
//! this process, hands the caller the recorded value itself, cloned, when the
//! `#[idempotent]` function's success type is `Clone`: nothing is decoded. Every other
//! replay decodes the record, and every one checks the fingerprint first. Such a replay
//! takes nothing of its store but the record: not even a handle.

use idem_runtime::ClaimRequest;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_runtime::{
    idempotent, Error, MemoryStore, Operation, Outcome, SqliteStore, Store, TieredStore,
};
use serde::{Deserialize, Deserializer, Serialize};

/// Defines a receipt type whose decodings are counted, each type with its own counter.
macro_rules! counted {
    ($name:ident, $decodes:ident $(, $derive:ident)*) => {
        static $decodes: AtomicUsize = AtomicUsize::new(0);

        #[derive(Debug, PartialEq $(, $derive)*)]
        struct $name {
            id: u64,
            customer: String,
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                (self.id, &self.customer).serialize(serializer)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                $decodes.fetch_add(1, Ordering::SeqCst);
                let (id, customer) = <(u64, String)>::deserialize(deserializer)?;
                Ok(Self { id, customer })
            }
        }
    };
}

counted!(Cloned, CLONED_DECODES, Clone);
counted!(Uncloned, UNCLONED_DECODES);

impl Cloned {
    fn new(id: u64) -> Self {
        Self {
            id,
            customer: "cus_0042".into(),
        }
    }
}

#[idempotent(key = id, fingerprint = amount, store = store, namespace = "typed.cloned")]
async fn cloned(store: &MemoryStore, id: u64, amount: u64) -> Result<Cloned, Error> {
    let _ = amount;
    Ok(Cloned::new(id))
}

#[idempotent(key = id, store = store, namespace = "typed.uncloned")]
async fn uncloned(store: &MemoryStore, id: u64) -> Result<Uncloned, Error> {
    Ok(Uncloned {
        id,
        customer: "cus_0042".into(),
    })
}

/// Another function under the same namespace and key as `cloned`, with another `Clone`
/// type: the value kept beside the record is not its type, so it decodes.
#[idempotent(key = id, fingerprint = amount, store = store, namespace = "typed.cloned")]
async fn other_type(store: &MemoryStore, id: u64, amount: u64) -> Result<(u64, String), Error> {
    let _ = amount;
    Ok((id, "never run".into()))
}

#[tokio::test]
async fn a_clone_type_is_replayed_without_decoding() {
    let store = MemoryStore::new();
    assert_eq!(cloned(&store, 1, 100).await.unwrap(), Cloned::new(1));
    // The one decoding so far is the record's check that it replays as itself.
    let recorded = CLONED_DECODES.load(Ordering::SeqCst);
    assert_eq!(recorded, 1, "the record is checked once");
    for _ in 0..3 {
        assert_eq!(cloned(&store, 1, 100).await.unwrap(), Cloned::new(1));
    }
    assert_eq!(
        CLONED_DECODES.load(Ordering::SeqCst),
        recorded,
        "a replay of a Clone type decoded its record"
    );

    // The fingerprint is checked on this path too, before any value is handed back.
    let err = cloned(&store, 1, 999).await.unwrap_err();
    assert!(matches!(err, Error::PayloadMismatch), "{err:?}");

    // A caller of another type gets the record decoded, never the other type's value.
    assert_eq!(
        other_type(&store, 1, 100).await.unwrap(),
        (1, "cus_0042".to_string())
    );
    // And the same value through `Operation::run`, which cannot know the type is `Clone`,
    // is decoded as well.
    let op = Operation::new("typed.cloned");
    let key = op.key(&1_u64).unwrap();
    let fingerprint = idem_runtime::Fingerprint::of(&100_u64).unwrap();
    let replayed = op
        .run(&store, &key, Some(&fingerprint), async {
            Ok::<_, Error>(Cloned::new(2))
        })
        .await
        .unwrap();
    assert_eq!(replayed, Outcome::Replayed(Cloned::new(1)));
    assert_eq!(CLONED_DECODES.load(Ordering::SeqCst), recorded + 1);
}

#[tokio::test]
async fn a_type_that_is_not_clone_is_decoded() {
    let store = MemoryStore::new();
    let first = uncloned(&store, 7).await.unwrap();
    let recorded = UNCLONED_DECODES.load(Ordering::SeqCst);
    assert_eq!(recorded, 1, "the record is checked once");
    let replayed = uncloned(&store, 7).await.unwrap();
    assert_eq!(first, replayed);
    assert_eq!(UNCLONED_DECODES.load(Ordering::SeqCst), recorded + 1);
}

/// A value with a field its encoding leaves out: what its first call returns and what
/// any replay of its record returns differ.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Annotated {
    id: u64,
    #[serde(skip)]
    note: String,
}

#[idempotent(key = id, store = store, namespace = "typed.annotated")]
async fn annotated(store: &MemoryStore, id: u64) -> Result<Annotated, Error> {
    Ok(Annotated {
        id,
        note: "known to the first call only".into(),
    })
}

#[idempotent(key = id, store = store, namespace = "typed.annotated")]
async fn annotated_durably(store: &SqliteStore, id: u64) -> Result<Annotated, Error> {
    Ok(Annotated {
        id,
        note: "known to the first call only".into(),
    })
}

#[tokio::test]
async fn a_replay_from_memory_is_what_a_replay_from_the_record_is() {
    let memory = MemoryStore::new();
    let first = annotated(&memory, 3).await.unwrap();
    assert_eq!(
        first.note, "known to the first call only",
        "the caller gets its value"
    );
    let from_memory = annotated(&memory, 3).await.unwrap();

    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("typed-annotated-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let durable = SqliteStore::open(&path).await.unwrap();
    durable.migrate().await.unwrap();
    annotated_durably(&durable, 3).await.unwrap();
    let from_the_record = annotated_durably(&durable, 3).await.unwrap();

    assert_eq!(
        from_the_record,
        Annotated {
            id: 3,
            note: String::new()
        },
        "a decoded replay has the skipped field's default"
    );
    assert_eq!(
        from_memory, from_the_record,
        "the value kept in memory is the record's, not a clone of the first call's"
    );
    let _ = std::fs::remove_file(&path);
}

counted!(Tiered, TIERED_DECODES, Clone);

#[idempotent(key = id, fingerprint = amount, store = store, namespace = "typed.tiered")]
async fn tiered(
    store: &TieredStore<MemoryStore, SqliteStore>,
    id: u64,
    amount: u64,
) -> Result<Tiered, Error> {
    let _ = amount;
    Ok(Tiered {
        id,
        customer: "cus_0042".into(),
    })
}

#[tokio::test]
async fn a_memory_tier_replays_a_result_completed_here_without_decoding() {
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("typed-tier-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let durable = SqliteStore::open(&path).await.unwrap();
    durable.migrate().await.unwrap();
    let store = TieredStore::new(MemoryStore::new(), durable.clone());
    let first = tiered(&store, 1, 100).await.unwrap();
    let recorded = TIERED_DECODES.load(Ordering::SeqCst);
    assert_eq!(recorded, 1, "the record is checked once");
    assert!(
        store.fast().peek(&tiered_key(1)).is_some(),
        "the completion copied the record into the fast tier"
    );
    for _ in 0..3 {
        assert_eq!(tiered(&store, 1, 100).await.unwrap(), first);
    }
    assert_eq!(
        TIERED_DECODES.load(Ordering::SeqCst),
        recorded,
        "a replay from the tier's copy decoded its record"
    );
    let err = tiered(&store, 1, 999).await.unwrap_err();
    assert!(matches!(err, Error::PayloadMismatch), "{err:?}");

    // Another process's tier (a fresh fast tier over the same durable store) copies the
    // record on its first replay; that copy was decoded by nobody here, so its replays
    // decode, and give the same value.
    let elsewhere = TieredStore::new(MemoryStore::new(), durable);
    for decodes in 1..=2 {
        assert_eq!(tiered(&elsewhere, 1, 100).await.unwrap(), first);
        assert_eq!(TIERED_DECODES.load(Ordering::SeqCst), recorded + decodes);
    }
    assert!(elsewhere.fast().peek(&tiered_key(1)).is_some(), "copied");
}

fn tiered_key(id: u64) -> idem_runtime::Key {
    Operation::new("typed.tiered").key(&id).unwrap()
}

/// A memory store whose handles count their clones: the handle a call takes of its store.
#[derive(Default)]
struct Handles {
    store: MemoryStore,
    clones: std::sync::Arc<AtomicUsize>,
}

impl Clone for Handles {
    fn clone(&self) -> Self {
        self.clones.fetch_add(1, Ordering::SeqCst);
        Self {
            store: self.store.clone(),
            clones: self.clones.clone(),
        }
    }
}

#[idem_runtime::async_trait]
impl Store for Handles {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<idem_runtime::Claim, Error> {
        self.store.claim(request).await
    }
    async fn complete(
        &self,
        key: &idem_runtime::Key,
        token: idem_runtime::Token,
        value: idem_runtime::Bytes,
        ttl: std::time::Duration,
    ) -> Result<bool, Error> {
        self.store.complete(key, token, value, ttl).await
    }
    async fn release(
        &self,
        key: &idem_runtime::Key,
        token: idem_runtime::Token,
    ) -> Result<bool, Error> {
        self.store.release(key, token).await
    }
    async fn renew(
        &self,
        key: &idem_runtime::Key,
        token: idem_runtime::Token,
        lease: std::time::Duration,
    ) -> Result<bool, Error> {
        self.store.renew(key, token, lease).await
    }
    async fn fence(
        &self,
        key: &idem_runtime::Key,
        token: idem_runtime::Token,
    ) -> Result<Option<idem_runtime::Token>, Error> {
        self.store.fence(key, token).await
    }
    async fn remove(&self, key: &idem_runtime::Key) -> Result<bool, Error> {
        self.store.remove(key).await
    }
    fn peek(&self, key: &idem_runtime::Key) -> Option<idem_runtime::Claim> {
        self.store.peek(key)
    }
    fn flights(&self) -> Option<&idem_runtime::Flights> {
        self.store.flights()
    }
}

#[idempotent(key = id, store = store, namespace = "typed.handles")]
async fn with_handles(store: &Handles, id: u64) -> Result<Cloned, Error> {
    Ok(Cloned::new(id))
}

#[idempotent(
    key = id,
    store = store,
    namespace = "typed.handles.complete",
    on_cancel = "complete"
)]
async fn completing_with_handles(store: Handles, id: u64) -> Result<Cloned, Error> {
    Ok(Cloned::new(id))
}

#[tokio::test]
async fn a_replay_from_memory_takes_no_handle_of_its_store() {
    let store = Handles::default();
    assert_eq!(with_handles(&store, 3).await.unwrap(), Cloned::new(3));
    // A first execution takes handles of its own: one to run in (the body may move what the
    // store expression borrowed), one its claim's guard shares.
    let first = store.clones.load(Ordering::SeqCst);
    assert!(first >= 1, "a first execution runs in a handle of its own");
    for _ in 0..3 {
        assert_eq!(with_handles(&store, 3).await.unwrap(), Cloned::new(3));
    }
    assert_eq!(
        store.clones.load(Ordering::SeqCst),
        first,
        "a replay answered from memory cloned its store"
    );

    // The same with `on_cancel = "complete"`, whose store is an owned argument: its clone,
    // made here, is the caller's.
    let argument = store.clone();
    completing_with_handles(argument, 4).await.unwrap();
    for _ in 0..3 {
        let argument = store.clone();
        let before = store.clones.load(Ordering::SeqCst);
        let replayed = completing_with_handles(argument, 4).await.unwrap();
        assert_eq!(replayed, Cloned::new(4));
        assert_eq!(
            store.clones.load(Ordering::SeqCst),
            before,
            "a completing replay answered from memory cloned its store"
        );
    }
}
