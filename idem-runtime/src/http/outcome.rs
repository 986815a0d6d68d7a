//! [`Outcome`] as an HTTP answer (feature `axum`).

use crate::Outcome;

/// An outcome answers HTTP as its value does; a replay adds `Idempotent-Replayed: true`, as
/// [`IdempotencyLayer`](crate::http::IdempotencyLayer)'s replays do (feature `axum`).
impl<T: axum::response::IntoResponse> axum::response::IntoResponse for Outcome<T> {
    fn into_response(self) -> axum::response::Response {
        let replayed = self.is_replayed();
        let mut response = self.into_inner().into_response();
        if replayed {
            response.headers_mut().insert(
                http::HeaderName::from_static(super::IDEMPOTENT_REPLAYED),
                http::HeaderValue::from_static("true"),
            );
        }
        response
    }
}
