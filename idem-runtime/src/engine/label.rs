//! A readable label for the calls a future makes: opt-in, none by default (a key can hold
//! an e-mail address, and a store keeps what it is given).

use std::future::Future;
use std::sync::Arc;

tokio::task_local! {
    static LABEL: Arc<str>;
}

/// Runs `calls` with every claim it makes labelled `label`: what an operator's listing
/// ([`admin`](crate::admin), `idem list`) shows beside the claim's digest, so that a held
/// key can be named without recomputing digests. The attribute's `label = …` argument is
/// this around the call.
///
/// Labels are opt-in because a store keeps what it is given: label with an order number,
/// not with an e-mail address. Calls made inside a labelled call's body carry the label too;
/// Redis keeps labels of at most 4 096 bytes (a longer one is kept as none).
pub async fn labelled<F: Future>(label: impl Into<Arc<str>>, calls: F) -> F::Output {
    LABEL.scope(label.into(), calls).await
}

/// The label of the call being claimed, if it runs inside [`labelled`].
pub(crate) fn current() -> Option<Arc<str>> {
    LABEL.try_with(Arc::clone).ok()
}
