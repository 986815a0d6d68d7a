//! With no tracing subscriber, a call's span still reaches a `log` logger that takes debug
//! records (through `tracing`'s `log` feature): building the span only when something can
//! see it must count such a logger as something.

use std::sync::Mutex;

use idem_runtime::{Error, MemoryStore, Operation};

/// Every record, as `target: message`.
struct Capture(Mutex<Vec<String>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let line = format!("{}: {}", record.target(), record.args());
        self.0.lock().unwrap().push(line);
    }

    fn flush(&self) {}
}

static CAPTURE: Capture = Capture(Mutex::new(Vec::new()));

#[tokio::test(flavor = "current_thread")]
async fn a_debug_logger_sees_the_span_of_a_first_execution_and_of_a_replay() {
    log::set_logger(&CAPTURE).unwrap();
    log::set_max_level(log::LevelFilter::Debug);
    assert!(
        !tracing::dispatcher::has_been_set(),
        "no subscriber in this process"
    );

    let store = MemoryStore::new();
    let op = Operation::new("log.fallback");
    let key = op.key(&"order-1").unwrap();
    let spans = || {
        let lines = CAPTURE.0.lock().unwrap();
        lines
            .iter()
            .filter(|line| line.contains("idempotent") && line.contains("log.fallback"))
            .count()
    };
    let first = op.run(&store, &key, None, async { Ok::<_, Error>(1) });
    assert!(!first.await.unwrap().is_replayed());
    let after_first = spans();
    assert!(
        after_first > 0,
        "no span line in {:?}",
        CAPTURE.0.lock().unwrap()
    );
    // The replay is answered at once from memory: its span is built on that path too.
    let again = op.run(&store, &key, None, async { Ok::<_, Error>(2) });
    assert!(again.await.unwrap().is_replayed());
    assert!(
        spans() > after_first,
        "no span line for the replay in {:?}",
        CAPTURE.0.lock().unwrap()
    );
}
