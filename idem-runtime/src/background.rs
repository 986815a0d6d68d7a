//! Work that outlives the call that started it, and [`drain`] to wait for it on shutdown.
//!
//! Three kinds: a body under `on_cancel = "complete"` whose caller went away, a completion
//! whose caller was dropped after the body returned, and a release whose caller was dropped
//! mid-body. Each is a tokio task counted here from before it is spawned until its future is
//! dropped, whether it ran to the end or the runtime shut down under it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::LazyLock;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

static RUNNING: AtomicUsize = AtomicUsize::new(0);
static IDLE: LazyLock<Notify> = LazyLock::new(Notify::new);

/// One unit of background work, counted while it lives.
struct Ticket;

impl Ticket {
    fn new() -> Self {
        RUNNING.fetch_add(1, Ordering::AcqRel);
        Self
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if RUNNING.fetch_sub(1, Ordering::AcqRel) == 1 {
            IDLE.notify_waiters();
        }
    }
}

/// Spawns `work` on `runtime`, counted until its future is dropped.
pub(crate) fn spawn<F>(runtime: &Handle, work: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let ticket = Ticket::new();
    runtime.spawn(async move {
        let _ticket = ticket;
        work.await
    })
}

/// `work` polled in its caller's task, and spawned on `runtime` to finish in the background
/// if the caller drops it before it is done: a body under `on_cancel = "complete"` costs no
/// task and no hand-off between workers unless its caller goes away.
pub(crate) fn finish_if_dropped<F>(runtime: Handle, work: F) -> FinishIfDropped<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    FinishIfDropped {
        runtime,
        work: Some(Box::pin(work)),
        polling: false,
    }
}

/// The future of [`finish_if_dropped`].
pub(crate) struct FinishIfDropped<T: 'static> {
    runtime: Handle,
    /// `None` once it has finished.
    work: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    /// Set while `work` is polled: a drop that finds it set follows a panic inside that
    /// poll, which goes on unwinding with `work` dropped, as a spawned task's panic would.
    polling: bool,
}

impl<T: 'static> Future for FinishIfDropped<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = &mut *self;
        let work = this
            .work
            .as_mut()
            .expect("a finished call is not polled again");
        this.polling = true;
        let polled = work.as_mut().poll(cx);
        this.polling = false;
        if polled.is_ready() {
            this.work = None;
        }
        polled
    }
}

impl<T: 'static> Drop for FinishIfDropped<T> {
    fn drop(&mut self) {
        if let Some(work) = self.work.take().filter(|_| !self.polling) {
            drop(spawn(&self.runtime, async move {
                work.await;
            }));
        }
    }
}

/// Waits until the background work of every idempotent call in this process has finished:
/// bodies finishing under `on_cancel = "complete"`, and the completions and releases of
/// calls that were dropped. Call it on shutdown, after the server stopped taking requests
/// and before the runtime is dropped; work still running then is cut off, and its keys are
/// freed only when their leases run out.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // … stop accepting requests, then:
/// if let Err(undrained) = idem_runtime::drain(std::time::Duration::from_secs(10)).await {
///     eprintln!("{undrained}");
/// }
/// # }
/// ```
///
/// # Errors
///
/// [`Undrained`] when work was still running at the deadline.
pub async fn drain(timeout: Duration) -> Result<(), Undrained> {
    let deadline = tokio::time::Instant::now() + timeout.min(crate::MAX_DURATION);
    loop {
        let idle = IDLE.notified();
        let mut idle = std::pin::pin!(idle);
        // Registered before the count is read, so that the last task's notification is seen.
        idle.as_mut().enable();
        let running = RUNNING.load(Ordering::Acquire);
        if running == 0 {
            return Ok(());
        }
        if tokio::time::timeout_at(deadline, idle).await.is_err() {
            return Err(Undrained {
                running: RUNNING.load(Ordering::Acquire),
            });
        }
    }
}

/// [`drain`]'s deadline passed with background work still running.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Undrained {
    running: usize,
}

impl Undrained {
    /// How many tasks were still running.
    pub fn running(&self) -> usize {
        self.running
    }
}

impl fmt::Display for Undrained {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} idempotent call(s) still finishing in the background at the deadline",
            self.running
        )
    }
}

impl std::error::Error for Undrained {}
