//! Key derivation does not touch the heap for keys without maps, and a memory replay only
//! for the clone of its value: a counting allocator, scoped to the test's own thread,
//! proves it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;

use idem_runtime::{Fingerprint, Key};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Heap allocations made by `f` on this thread.
fn allocations<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let before = ALLOCATIONS.with(Cell::get);
    let out = f();
    (ALLOCATIONS.with(Cell::get) - before, out)
}

#[derive(serde::Serialize)]
struct Order<'a> {
    id: u64,
    customer: &'a str,
    lines: (u32, u32),
    note: Option<&'a str>,
}

#[test]
fn the_counter_sees_allocations() {
    let (n, v) = allocations(|| Vec::<u8>::with_capacity(16));
    assert_eq!(n, 1);
    drop(v);
}

#[test]
fn deriving_a_key_without_maps_allocates_nothing() {
    let customer = String::from("cus_7");
    let (n, key) =
        allocations(|| Key::derive("billing.charge.v1", &(42_u64, customer.as_str(), 3_u32)));
    assert!(key.is_ok());
    assert_eq!(n, 0, "the P9 key (u64, &str, u32) allocated");

    let order = Order {
        id: 1,
        customer: &customer,
        lines: (2, 3),
        note: Some("gift"),
    };
    let (n, _) = allocations(|| Key::derive("billing.charge.v1", &order));
    assert_eq!(n, 0, "a struct key allocated");
    let (n, _) = allocations(|| Fingerprint::of(&order));
    assert_eq!(n, 0, "a fingerprint allocated");
}

#[test]
fn maps_are_the_one_place_that_allocates() {
    let map: BTreeMap<&str, u32> = [("a", 1), ("b", 2)].into();
    let (n, _) = allocations(|| Key::derive("ns", &map));
    assert!(n > 0, "sorting map entries needs a buffer");
}

#[test]
fn cloning_an_operation_allocates_nothing_whatever_its_namespace() {
    // A spawned body (`on_cancel = "complete"`, the HTTP layer) clones its operation.
    let owned = idem_runtime::Operation::new(format!("tenant-{}.charge.v1", 42));
    let fixed = idem_runtime::Operation::new("billing.charge.v1");
    let (n, clones) = allocations(|| (owned.clone(), fixed.clone()));
    assert_eq!(n, 0, "cloning an operation allocated");
    assert_eq!(clones.0.namespace(), "tenant-42.charge.v1");
    assert_eq!(clones.1.namespace(), "billing.charge.v1");
}

#[test]
fn a_memory_replay_is_answered_in_one_poll_without_allocating() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    use idem_runtime::{Error, MemoryStore, Operation, Outcome};

    let store = MemoryStore::new();
    let op = Operation::new("billing.charge.v1");
    let key = op.key(&42_u64).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let first = runtime.block_on(op.run(&store, &key, None, async { Ok::<_, Error>(7_u64) }));
    assert_eq!(first.unwrap(), Outcome::Executed(7));

    // No runtime, one poll: the replay is answered synchronously, from memory. The first
    // replay registers its log events' callsites with `tracing` (once per process) and
    // builds the namespace's metric keys (once per thread: this workspace's test build has
    // the `metrics` feature on); the second is the steady state.
    let replay_once = || {
        let mut replay =
            std::pin::pin!(op.run(&store, &key, None, async { Ok::<_, Error>(8_u64) }));
        replay
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
    };
    let _ = replay_once();
    let (n, polled) = allocations(replay_once);
    assert!(
        matches!(polled, Poll::Ready(Ok(Outcome::Replayed(7)))),
        "{polled:?}"
    );
    assert_eq!(n, 0, "a memory replay of a u64 allocated");
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Named {
    id: u64,
    customer: String,
}

#[idem_runtime::idempotent(key = id, store = store, namespace = "billing.named.v1")]
async fn named(store: &idem_runtime::MemoryStore, id: u64) -> Result<Named, idem_runtime::Error> {
    Ok(Named {
        id,
        customer: "cus_0042".to_string(),
    })
}

#[test]
fn a_memory_replay_of_a_clone_type_allocates_only_the_clone() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    let store = idem_runtime::MemoryStore::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let first = runtime.block_on(named(&store, 42)).unwrap();
    let replay_once = || {
        std::pin::pin!(named(&store, 42))
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
    };
    let _ = replay_once();
    let (n, polled) = allocations(replay_once);
    assert!(
        matches!(&polled, Poll::Ready(Ok(value)) if *value == first),
        "{polled:?}"
    );
    // The clone of the one `String` in the value, and nothing else: the record is not
    // decoded, and the metric keys were built by the first replay.
    assert_eq!(n, 1, "a memory replay allocated beyond the value's clone");
}

#[idem_runtime::idempotent(key = id, store = store, namespace = "billing.finished.v1", on_cancel = "complete")]
async fn finished(store: idem_runtime::MemoryStore, id: u64) -> Result<Named, idem_runtime::Error> {
    Ok(Named {
        id,
        customer: "cus_0042".to_string(),
    })
}

/// An `#[idempotent]` function's future holds its arguments and room for its answer: the
/// call's own state (about a kilobyte) and its body's are boxed by a call that runs, so
/// that a replay answered at once moves no more than that wherever its future goes (a
/// task, an outer future). Both were over a kilobyte before the call's state was boxed.
#[test]
fn an_idempotent_functions_future_does_not_carry_the_call() {
    let store = idem_runtime::MemoryStore::new();
    let bound = 512;
    let named = std::mem::size_of_val(&named(&store, 42));
    let finished = std::mem::size_of_val(&finished(store.clone(), 42));
    assert!(named <= bound, "named's future is {named} bytes");
    assert!(finished <= bound, "finished's future is {finished} bytes");
}
