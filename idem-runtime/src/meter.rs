//! Where the engine reports outcomes to the `metrics` facade; nothing without the feature.

use std::time::Duration;

use crate::namespace::Namespace;

/// How a keyed call ended, as [`crate::metrics`] counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    Executed,
    Replayed,
    Released,
    Rejected,
    Mismatched,
}

impl Event {
    /// Every event, in declaration order (each at its own index, `event as usize`).
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    const ALL: [Self; 5] = [
        Self::Executed,
        Self::Replayed,
        Self::Released,
        Self::Rejected,
        Self::Mismatched,
    ];

    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::Released => "released",
            Self::Rejected => "rejected",
            Self::Mismatched => "mismatched",
        }
    }

    /// The event of a call's error, if it is one.
    pub(crate) fn of(error: &crate::Error) -> Option<Self> {
        match error {
            crate::Error::InProgress => Some(Self::Rejected),
            crate::Error::PayloadMismatch => Some(Self::Mismatched),
            _ => None,
        }
    }
}

/// Counts one call of `namespace` that ended with `event`.
#[cfg(feature = "metrics")]
pub(crate) fn count(namespace: &Namespace, event: Event) {
    report(namespace, None, Some(event));
}

/// Reports a settled claim of `namespace` at once: how long it took (if measured) and its
/// event (if it decided one), with the namespace's keys looked up once for both.
#[cfg(feature = "metrics")]
fn report(namespace: &Namespace, took: Option<Duration>, event: Option<Event>) {
    if took.is_none() && event.is_none() {
        return;
    }
    let keys = keys::of(namespace);
    if let Some(took) = took {
        ::metrics::with_recorder(|recorder| {
            recorder.register_histogram(keys.claim(), &keys::METADATA)
        })
        .record(took.as_secs_f64());
    }
    if let Some(event) = event {
        ::metrics::with_recorder(|recorder| {
            recorder.register_counter(keys.call(event), &keys::METADATA)
        })
        .increment(1);
    }
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn count(_: &Namespace, _: Event) {}

#[cfg(not(feature = "metrics"))]
fn report(_: &Namespace, _: Option<Duration>, _: Option<Event>) {}

/// The metric keys of recent namespaces, built once per thread: a key with a label is a
/// heap allocation, and building two of them on every call cost a memory replay more
/// than its own bookkeeping (75 ns of 540 in the paths bench's P1b).
#[cfg(feature = "metrics")]
mod keys {
    use std::cell::{OnceCell, RefCell};
    use std::rc::Rc;

    use metrics::{Key, Label, Level, Metadata};

    use super::Event;
    use crate::metrics::{CALLS, CLAIM_DURATION};
    use crate::namespace::Namespace;

    /// What the `metrics` macros would attach, as they would from this module.
    pub(super) static METADATA: Metadata<'static> =
        Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

    /// The keys of one namespace, each built when first used: a namespace made anew for
    /// every call (which the cache can only miss) costs no more keys than it uses.
    pub(super) struct Keys {
        namespace: Namespace,
        /// By [`Event`], in declaration order.
        calls: [OnceCell<Key>; Event::ALL.len()],
        claim: OnceCell<Key>,
    }

    impl Keys {
        fn new(namespace: &Namespace) -> Self {
            Self {
                namespace: namespace.clone(),
                calls: Default::default(),
                claim: OnceCell::new(),
            }
        }

        fn label(&self) -> Label {
            Label::new("namespace", self.namespace.label())
        }

        /// The counter's key for `event`.
        pub(super) fn call(&self, event: Event) -> &Key {
            self.calls[event as usize].get_or_init(|| {
                Key::from_parts(
                    CALLS,
                    vec![self.label(), Label::new("outcome", event.as_str())],
                )
            })
        }

        /// The claim latency histogram's key.
        pub(super) fn claim(&self) -> &Key {
            self.claim
                .get_or_init(|| Key::from_parts(CLAIM_DURATION, vec![self.label()]))
        }
    }

    /// How many namespaces a thread keeps the keys of. A slot holds its namespace, so a
    /// shared name cannot be freed and its address reused by another while it is cached.
    const SLOTS: usize = 8;

    thread_local! {
        static CACHE: RefCell<[Option<Rc<Keys>>; SLOTS]> =
            const { RefCell::new([const { None }; SLOTS]) };
    }

    /// The keys of `namespace`, from this thread's cache, or new (and cached) now.
    pub(super) fn of(namespace: &Namespace) -> Rc<Keys> {
        CACHE.with(|cache| {
            let slot = &mut cache.borrow_mut()[namespace.address() % SLOTS];
            match slot {
                Some(keys) if keys.namespace.is(namespace) => Rc::clone(keys),
                _ => Rc::clone(slot.insert(Rc::new(Keys::new(namespace)))),
            }
        })
    }
}

/// The start of a claim, when its latency is measured.
pub(crate) fn start() -> Option<tokio::time::Instant> {
    cfg!(feature = "metrics").then(tokio::time::Instant::now)
}

/// Reports how a call's claim settled: its latency since `started`, and its event if the
/// settling decided it (a replay, a rejection, a mismatch).
pub(crate) fn settled<T>(
    namespace: &Namespace,
    started: Option<tokio::time::Instant>,
    result: &Result<T, crate::Error>,
    replayed: impl FnOnce(&T) -> bool,
) {
    let took = started.map(|started| started.elapsed());
    report(namespace, took, decided(result, replayed));
}

/// Reports a claim settled without waiting, from a record in this process's memory: its
/// latency is recorded as zero. It is a fraction of a microsecond, below any histogram's
/// first bucket, and reading the clock twice to measure it would cost the replay more than
/// all of its own work but the key's hash and the cache lookup.
pub(crate) fn settled_at_once<T>(namespace: &Namespace, result: &Result<T, crate::Error>) {
    report(namespace, Some(Duration::ZERO), decided(result, |_| true));
}

/// The event a settled claim decided, if it decided one.
fn decided<T>(
    result: &Result<T, crate::Error>,
    replayed: impl FnOnce(&T) -> bool,
) -> Option<Event> {
    match result {
        Ok(settled) => replayed(settled).then_some(Event::Replayed),
        Err(error) => Event::of(error),
    }
}

#[cfg(test)]
mod tests {
    use super::Event;

    #[test]
    fn every_event_is_at_its_own_index() {
        for (index, event) in Event::ALL.into_iter().enumerate() {
            assert_eq!(event as usize, index, "{event:?}");
        }
    }
}
