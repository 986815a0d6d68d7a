//! A claim held by this call: renewed while the body runs, completed or released exactly
//! once, and released by a drop guard when the body panics or the call is cancelled.

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;

use crate::flights::{Flight, Landing};
use crate::{Fingerprint, Key, Store, Token};

pub(super) struct Held<S: Store + Clone> {
    store: S,
    key: Key,
    token: Token,
    /// This call's entry in the store's in-process registry, for its waiters.
    flight: Option<Arc<Flight>>,
    /// Whether dropping the guard must still release the claim.
    armed: bool,
}

impl<S: Store + Clone> Held<S> {
    pub(super) fn new(store: S, key: Key, fingerprint: Option<Fingerprint>, token: Token) -> Self {
        let flight = store
            .flights()
            .map(|flights| flights.start(key, fingerprint));
        Self {
            store,
            key,
            token,
            flight,
            armed: true,
        }
    }

    /// Polls `body` to completion while renewing the lease every third of it.
    pub(super) async fn renewing<F: Future>(&self, lease: Duration, body: F) -> F::Output {
        let mut body = pin!(body);
        let mut heartbeat = pin!(self.heartbeat(lease));
        poll_fn(|cx| {
            if let Poll::Ready(output) = body.as_mut().poll(cx) {
                return Poll::Ready(output);
            }
            // The heartbeat never finishes; it only needs to be polled beside the body.
            let _ = heartbeat.as_mut().poll(cx);
            Poll::Pending
        })
        .await
    }

    async fn heartbeat(&self, lease: Duration) {
        let period = lease / 3;
        loop {
            tokio::time::sleep(period).await;
            match self.store.renew(&self.key, self.token, lease).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(
                        outcome = "lease lost",
                        token = self.token.get(),
                        "the claim was taken over while the body ran; its result will not be recorded"
                    );
                    return std::future::pending().await;
                }
                Err(err) => tracing::warn!(error = %err, "renewing the lease failed; retrying"),
            }
        }
    }

    /// Records `record` under this claim and hands it to the waiters.
    ///
    /// The guard stays armed until the store answers: if this future is dropped mid-way, the
    /// guard's release is refused by the token check should the completion have landed.
    pub(super) async fn complete(mut self, record: Bytes, ttl: Duration) {
        let landing = match self
            .store
            .complete(&self.key, self.token, record.clone(), ttl)
            .await
        {
            Ok(true) => Landing::Completed(record),
            Ok(false) => {
                tracing::warn!(
                    outcome = "lease lost",
                    token = self.token.get(),
                    "the claim was taken over before completion; the result was not recorded"
                );
                // Another holder owns the key now: the waiters ask the store, which has the
                // one result every later call will see.
                Landing::Released
            }
            Err(err) => {
                tracing::warn!(
                    error = %err,
                    "recording the result failed; the key is freed when its lease runs out"
                );
                // The body ran once and this is what it returned; asking the store again
                // would only wait for the lease.
                Landing::Completed(record)
            }
        };
        self.land(landing);
        self.armed = false;
    }

    /// Releases the claim so that the next call runs the body.
    pub(super) async fn release(mut self) {
        release(&self.store, &self.key, self.token).await;
        self.land(Landing::Released);
        self.armed = false;
    }

    fn land(&mut self, landing: Landing) {
        land(&self.store, &self.key, self.flight.take(), landing);
    }
}

impl<S: Store + Clone> Drop for Held<S> {
    /// The body panicked or the call was dropped mid-body: release in the background.
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, key, token, flight) =
            (self.store.clone(), self.key, self.token, self.flight.take());
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                tracing::debug!(outcome = "released", "the call was cancelled or panicked");
                runtime.spawn(async move {
                    release(&store, &key, token).await;
                    land(&store, &key, flight, Landing::Released);
                });
            }
            Err(_) => {
                tracing::warn!(
                    outcome = "released",
                    "dropped outside a tokio runtime: the key is freed when its lease runs out"
                );
                land(&store, &key, flight, Landing::Released);
            }
        }
    }
}

async fn release<S: Store>(store: &S, key: &Key, token: Token) {
    match store.release(key, token).await {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            outcome = "lease lost",
            token = token.get(),
            "the claim was taken over before it could be released"
        ),
        Err(err) => tracing::warn!(
            error = %err,
            "releasing the claim failed; the key is freed when its lease runs out"
        ),
    }
}

fn land<S: Store>(store: &S, key: &Key, flight: Option<Arc<Flight>>, landing: Landing) {
    if let (Some(flights), Some(flight)) = (store.flights(), flight) {
        flights.land(key, &flight, landing);
    }
}
