//! Every answer the layer gives on its own, as RFC 9457 problem details
//! (`application/problem+json`), built here and nowhere else.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::Full;

use crate::Error;

/// The documentation of each problem type: the `type` member of the problem is this page's
/// URL with the problem's anchor.
const TYPES: &str = "https://docs.rs/idem-runtime/latest/idem_runtime/http/index.html";

/// A problem the layer answers with instead of running the handler.
#[derive(Debug)]
pub(super) enum Problem {
    /// 400: the key is required and missing.
    KeyMissing,
    /// 400: the key header is malformed.
    KeyMalformed(&'static str),
    /// 400: the request body could not be read, or fingerprinted.
    BodyUnreadable(String),
    /// 413: the request body is over the limit.
    BodyTooLarge(usize),
    /// 409: the key's first request still runs.
    InFlight(Duration),
    /// 422: the key was used with another request.
    PayloadMismatch,
    /// 503: the store failed; the handler did not run.
    StoreDown,
    /// 500: a record that does not decode, a misconfiguration, a failed response body.
    Internal(String),
}

impl Problem {
    /// The problem of an [`Error`] from the engine.
    pub(super) fn of(err: Error, retry_after: Duration) -> Self {
        match err {
            Error::InProgress => Self::InFlight(retry_after),
            Error::PayloadMismatch => Self::PayloadMismatch,
            Error::Store(_) => Self::StoreDown,
            Error::Key(e) => Self::BodyUnreadable(e.to_string()),
            other => Self::Internal(other.to_string()),
        }
    }

    pub(super) fn into_response(self) -> Response<Full<Bytes>> {
        let retry_after = match &self {
            Self::InFlight(after) => Some(*after),
            _ => None,
        };
        let (status, anchor, title, detail) = match self {
            Self::KeyMissing => (
                StatusCode::BAD_REQUEST,
                "key-missing",
                "Idempotency-Key is missing",
                "this endpoint requires an `Idempotency-Key` header; send a unique value per operation and the same one on every retry".to_string(),
            ),
            Self::KeyMalformed(why) => (
                StatusCode::BAD_REQUEST,
                "key-malformed",
                "Idempotency-Key is malformed",
                format!("{why}: send one quoted string of at most 255 characters, e.g. `Idempotency-Key: \"8e03978e-40d5\"`"),
            ),
            Self::BodyUnreadable(why) => (
                StatusCode::BAD_REQUEST,
                "body-unreadable",
                "The request body could not be read",
                why,
            ),
            Self::BodyTooLarge(limit) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "The request body is too large",
                format!("requests with an `Idempotency-Key` may carry at most {limit} bytes"),
            ),
            Self::InFlight(_) => (
                StatusCode::CONFLICT,
                "in-flight",
                "A request with this Idempotency-Key is in progress",
                "the first request with this key has not finished; retry after the `Retry-After` delay to get its response".to_string(),
            ),
            Self::PayloadMismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "key-reused",
                "Idempotency-Key reused with another request",
                "this key was used before with a different method, path, query or body; use a new key for a new operation".to_string(),
            ),
            Self::StoreDown => (
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "Idempotency store unavailable",
                "the request was not processed; retry it with the same key".to_string(),
            ),
            Self::Internal(why) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Idempotency layer failure",
                why,
            ),
        };
        let body = serde_json::json!({
            "type": format!("{TYPES}#{anchor}"),
            "title": title,
            "status": status.as_u16(),
            "detail": detail,
        });
        let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(after.as_secs().max(1)));
        }
        response
    }
}
