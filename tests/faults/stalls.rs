//! A claim sent again after a store failure shares one deadline with the first try: a call
//! on a store that stalls fails after the store's timeout, not after one timeout per try.
//! The clock is tokio's, paused: the figures are exact and a busy machine cannot move them.

use idem_runtime::ClaimRequest;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::{
    async_trait, Bytes, Claim, Error, Key, MemoryStore, Operation, Outcome, Store, Token,
};
use idem_tests::scenarios::namespace;
use tokio::time::Instant;

const TIMEOUT: Duration = Duration::from_secs(3);

/// What the store does with each claim, in order; past the end, the claims pass.
#[derive(Clone, Copy)]
enum Try {
    /// Fails at once, as a refused connection.
    Fails,
    /// Answers nothing until the store's timeout, then fails, as a partition.
    Stalls,
}

/// A memory store whose claims go through a script of failures first, with a timeout of
/// its own as a network store has.
#[derive(Clone)]
struct Scripted {
    inner: MemoryStore,
    script: Arc<Vec<Try>>,
    claims: Arc<AtomicUsize>,
}

impl Scripted {
    fn new(script: &[Try]) -> Self {
        Self {
            inner: MemoryStore::new(),
            script: Arc::new(script.to_vec()),
            claims: Arc::default(),
        }
    }
}

#[async_trait]
impl Store for Scripted {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        let n = self.claims.fetch_add(1, Ordering::SeqCst);
        match self.script.get(n) {
            Some(Try::Fails) => Err(Error::store("refused")),
            Some(Try::Stalls) => {
                tokio::time::sleep(TIMEOUT).await;
                Err(Error::store("no answer within the timeout"))
            }
            None => self.inner.claim(request).await,
        }
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.inner.complete(key, token, value, ttl).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        self.inner.release(key, token).await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        self.inner.renew(key, token, lease).await
    }

    async fn fence(&self, key: &Key, token: Token) -> Result<Option<Token>, Error> {
        self.inner.fence(key, token).await
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        self.inner.remove(key).await
    }

    fn claim_timeout(&self) -> Option<Duration> {
        Some(TIMEOUT)
    }
}

/// Runs one call on `store`: its answer and how long it took by tokio's clock.
async fn call(store: &Scripted) -> (Result<Outcome<u32>, Error>, Duration) {
    let op = Operation::new(namespace("faults.stalls"));
    let key = op.key(&1_u32).unwrap();
    let started = Instant::now();
    let answered = op.run(store, &key, None, async { Ok::<_, Error>(7) }).await;
    (answered, started.elapsed())
}

#[tokio::test(start_paused = true)]
async fn a_stalled_claim_is_not_sent_again_past_the_timeout() {
    let store = Scripted::new(&[Try::Stalls, Try::Stalls, Try::Stalls]);
    let (answered, took) = call(&store).await;
    assert!(matches!(answered, Err(Error::Store(_))), "{answered:?}");
    assert_eq!(took, TIMEOUT, "one timeout, not one per try");
    assert_eq!(store.claims.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_claim_sent_again_ends_at_the_first_tries_deadline() {
    // Refused at once, then stalled: the second try is cut where the first one's timeout
    // would have ended, not a whole timeout later.
    let store = Scripted::new(&[Try::Fails, Try::Stalls, Try::Stalls]);
    let (answered, took) = call(&store).await;
    let err = answered.unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err:?}");
    assert!(err.to_string().contains("store"), "{err}");
    assert_eq!(took, TIMEOUT);
    assert_eq!(store.claims.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn failures_that_leave_time_are_tried_again() {
    // Two quick failures (a lost reply, a reset connection) and the third try lands.
    let store = Scripted::new(&[Try::Fails, Try::Fails]);
    let (answered, took) = call(&store).await;
    assert_eq!(answered.unwrap(), Outcome::Executed(7));
    assert!(took < TIMEOUT, "{took:?}");
    assert_eq!(store.claims.load(Ordering::SeqCst), 3);
}
