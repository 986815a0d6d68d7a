//! Tracing: every call reports its outcome in a span carrying the namespace and a short key
//! digest, and the raw key value never reaches a span or an event.

use idem_runtime::ClaimRequest;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use idem_runtime::{Error, Fingerprint, InFlight, MemoryStore, Operation, Outcome};
use idem_tests::Probe;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Records every span and event as a line of `name=value` fields.
#[derive(Clone, Default)]
struct Capture {
    lines: Arc<Mutex<Vec<String>>>,
    ids: Arc<AtomicU64>,
}

struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={:?} ", field.name(), value));
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut line = Line(format!("span {} ", span.metadata().name()));
        span.record(&mut line);
        self.lines.lock().unwrap().push(line.0);
        Id::from_u64(self.ids.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut line = Line(format!("event {} ", event.metadata().level()));
        event.record(&mut line);
        self.lines.lock().unwrap().push(line.0);
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[tokio::test(flavor = "current_thread")]
async fn outcomes_are_traced_without_the_raw_key() {
    let capture = Capture::default();
    let _guard = tracing::subscriber::set_default(capture.clone());

    let store = MemoryStore::new();
    let op = Operation::new("observability.charge");
    let secret = "secret-order-77";
    let key = op.key(&secret).unwrap();
    let fp = Fingerprint::of(&1).unwrap();
    let first = op.run(&store, &key, Some(&fp), async { Ok::<_, Error>(1) });
    assert!(!first.await.unwrap().is_replayed());
    let again = op.run(&store, &key, Some(&fp), async { Ok::<_, Error>(2) });
    assert!(again.await.unwrap().is_replayed());
    let other = Fingerprint::of(&2).unwrap();
    let _ = op
        .run(&store, &key, Some(&other), async { Ok::<_, Error>(3) })
        .await;

    let busy = op.key(&"busy").unwrap();
    let reject = op.clone().in_flight(InFlight::Reject);
    let (hold, release) = tokio::sync::oneshot::channel::<()>();
    let first = op.run(&store, &busy, None, async move {
        let _ = release.await;
        Ok::<_, Error>(0)
    });
    let second = async {
        tokio::task::yield_now().await;
        let rejected = reject
            .run(&store, &busy, None, async { Ok::<_, Error>(1) })
            .await;
        let _ = hold.send(());
        rejected
    };
    let (_, rejected) = tokio::join!(first, second);
    assert!(matches!(rejected, Err(Error::InProgress)));

    let lines = capture.lines.lock().unwrap().clone();
    let text = lines.join("\n");
    for outcome in ["executed", "replayed", "mismatch", "rejected"] {
        assert!(
            text.contains(&format!("outcome={outcome:?}")),
            "no {outcome} in:\n{text}"
        );
    }
    assert!(
        lines
            .iter()
            .any(|l| l.contains("outcome=\"executed\"") && l.contains("elapsed_ms=")),
        "an execution reports its duration:\n{text}"
    );
    let short = key.short().to_string();
    assert!(
        lines.iter().any(|l| l.starts_with("span idempotent")
            && l.contains("namespace=observability.charge")
            && l.contains(&short)),
        "no span with the namespace and the short key in:\n{text}"
    );
    assert!(!text.contains(secret), "the raw key leaked:\n{text}");
    assert!(
        !text.contains(&key.to_hex()),
        "the full digest is not logged either"
    );
}

// Paused time: the memory store's leases follow tokio's clock, so the takeover happens at the
// same virtual instant however busy the machine is.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_lost_lease_is_reported_as_a_warning() {
    let capture = Capture::default();
    let _guard = tracing::subscriber::set_default(capture.clone());

    let store = MemoryStore::new();
    let lease = idem_runtime::MIN_LEASE;
    let op = Operation::new("observability.zombie").lease(lease);
    let key = op.key(&1).unwrap();
    // A holder that never renews (a process paused past its lease) is taken over.
    let zombie_store = Probe::frozen(store.clone());
    let zombie = op.run(&zombie_store, &key, None, async {
        tokio::time::sleep(lease * 4).await;
        Ok::<_, Error>(1)
    });
    let owner = async {
        tokio::time::sleep(lease * 2).await;
        op.run(&Probe::frozen(store.clone()), &key, None, async {
            Ok::<_, Error>(2)
        })
        .await
    };
    let (zombie, owner) = tokio::join!(zombie, owner);
    assert_eq!(owner.unwrap(), Outcome::Executed(2));
    // The zombie's caller is told its body ran unrecorded; the key's value is the owner's.
    assert!(matches!(zombie, Err(Error::Unrecorded(_))), "{zombie:?}");

    let lines = capture.lines.lock().unwrap().clone();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("event WARN") && l.contains("outcome=\"lease lost\"")),
        "no warning for the lost lease in:\n{}",
        lines.join("\n")
    );
}

/// A call that waits on a key another process holds says so, once, at `info`: whom it waits
/// for (the holder), what its lease has left, and how long it will wait.
#[tokio::test(flavor = "current_thread")]
async fn a_wait_on_another_process_names_the_holder_and_its_lease() {
    use idem_runtime::store::Claimant;
    use idem_runtime::{Claim, Store};

    let capture = Capture::default();
    let _guard = tracing::subscriber::set_default(capture.clone());
    let store = MemoryStore::new();
    let op = Operation::new("observability.wait").wait(std::time::Duration::from_millis(50));
    let key = op.key(&1).unwrap();
    // A claim made outside this call's registry, as another process's would be.
    let claimed = store
        .claim(
            &ClaimRequest::new(&key, std::time::Duration::from_secs(300))
                .nonce(1)
                .claimant(Claimant::new("observability.wait")),
        )
        .await
        .unwrap();
    assert!(matches!(claimed, Claim::Acquired { .. }));
    let waited = op
        .run(&store, &key, None, async { Ok::<_, Error>(1) })
        .await;
    assert!(matches!(waited, Err(Error::InProgress)), "{waited:?}");
    let lines = capture.lines.lock().unwrap().clone();
    let waiting: Vec<_> = lines
        .iter()
        .filter(|line| line.contains("waiting on a key another process holds"))
        .collect();
    assert_eq!(waiting.len(), 1, "{lines:#?}");
    let line = waiting[0];
    assert!(line.starts_with("event INFO"), "{line}");
    assert!(
        line.contains(&format!("holder=pid {} on ", std::process::id())),
        "{line}"
    );
    assert!(line.contains("lease_left_ms="), "{line}");
    assert!(line.contains("wait_ms="), "{line}");
}

/// A store that is away for a while, under one call: its renewals and its completion fail
/// many times before they land. The call says so once at `warn` for each kind of write
/// (the renewals' outage, the completion's), and the retries at `debug`: an outage is a
/// line or two in the logs, not one per try.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_outage_under_one_call_is_a_warning_or_two_not_one_a_try() {
    let capture = Capture::default();
    let _guard = tracing::subscriber::set_default(capture.clone());

    let store = Probe::new(MemoryStore::new());
    let lease = std::time::Duration::from_secs(8);
    let op = Operation::new("observability.outage").lease(lease);
    let key = op.key(&1).unwrap();
    store.fail_renewals(6);
    store.fail_completes(6);
    let done = op
        .run(&store, &key, None, async {
            // Long enough for the renewals (every quarter lease) to fail their six times.
            tokio::time::sleep(lease * 3).await;
            Ok::<_, Error>(1)
        })
        .await
        .unwrap();
    assert_eq!(done, Outcome::Executed(1));
    let lines = capture.lines.lock().unwrap().clone();
    let warnings: Vec<_> = lines
        .iter()
        .filter(|l| l.starts_with("event WARN"))
        .collect();
    let retried = lines
        .iter()
        .filter(|l| l.starts_with("event DEBUG") && l.contains("failed; retrying"))
        .count();
    assert!(
        retried >= 8,
        "the retries are at debug:\n{}",
        lines.join("\n")
    );
    assert!(
        warnings.len() <= 2,
        "{} warnings for one outage:\n{}",
        warnings.len(),
        lines.join("\n")
    );
}

/// A delivery of no broker, for the consumer's logs and labels.
struct Delivered {
    payload: &'static [u8],
    id: &'static str,
}

#[idem_runtime::store::async_trait]
impl idem_runtime::consumer::Delivery for Delivered {
    fn payload(&self) -> &[u8] {
        self.payload
    }
    fn message_id(&self) -> Option<std::borrow::Cow<'_, str>> {
        Some(self.id.into())
    }
    fn header(&self, _: &str) -> Option<std::borrow::Cow<'_, str>> {
        None
    }
    fn deliveries(&self) -> Option<u64> {
        None
    }
    async fn settle(
        &self,
        _: idem_runtime::consumer::Disposition,
    ) -> Result<(), idem_runtime::BoxError> {
        Ok(())
    }
}

/// An operator looking for a message finds it by its id: the handler's claim is labelled
/// with it while it runs, and a message rejected for good (its id reused with another
/// payload) is logged at `warn` with it.
#[tokio::test(flavor = "current_thread")]
async fn a_consumed_message_is_found_by_its_id_in_claims_and_rejections() {
    use idem_runtime::admin::{Admin, Filter};
    use idem_runtime::consumer::{Consumer, Disposition};

    let capture = Capture::default();
    let _guard = tracing::subscriber::set_default(capture.clone());
    let store = MemoryStore::new();
    let consumer = Consumer::new("observability.consumer").store(store.clone());
    let first = Delivered {
        payload: b"1",
        id: "m-7",
    };
    let settled = consumer
        .handle(&first, |n: u32| {
            let store = store.clone();
            async move {
                let filter = Filter::namespace("observability.consumer").label("m-7");
                let labelled = store.list(&filter, None).await?;
                assert_eq!(labelled.entries().len(), 1, "{labelled:?}");
                Ok::<_, Error>(n)
            }
        })
        .await
        .unwrap();
    assert_eq!(settled, Disposition::Ack);
    let reused = Delivered {
        payload: b"2",
        id: "m-7",
    };
    let settled = consumer
        .handle(&reused, |n: u32| async move { Ok::<_, Error>(n) })
        .await
        .unwrap();
    assert_eq!(settled, Disposition::Reject);
    let lines = capture.lines.lock().unwrap().clone();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("event WARN") && l.contains(r#"message_id="m-7""#)),
        "{}",
        lines.join("\n")
    );
}
