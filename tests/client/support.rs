//! What the client tests share: a quick retry policy and a response's `Delivery`.

use std::time::Duration;

use http::Response;
use idem_runtime::http::client::{Delivery, Retry};

/// Six attempts, 1 to 5 ms apart: retries without waiting long.
pub fn fast() -> Retry {
    Retry::new()
        .attempts(6)
        .backoff(Duration::from_millis(1), Duration::from_millis(5))
}

/// How a keyed request's answer was delivered.
pub fn delivery<B>(response: &Response<B>) -> Delivery {
    response
        .extensions()
        .get::<Delivery>()
        .cloned()
        .expect("a keyed request has a Delivery")
}
