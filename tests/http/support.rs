//! What the HTTP tests share: an axum app whose handlers count their runs, a server on a
//! free loopback port, and a hyper client that reads whole answers.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem_runtime::http::{IdempotencyKey, IdempotencyLayer};
use idem_runtime::Store;
use idem_tests::scenarios::namespace;
use tokio::sync::{Notify, Semaphore};

/// What the handlers saw and how the test steers them.
#[derive(Clone)]
pub struct App {
    /// Handler runs.
    pub runs: Arc<AtomicUsize>,
    /// Signalled when a gated handler is entered.
    pub entered: Arc<Notify>,
    /// Gated handlers wait for a permit here.
    pub gate: Arc<Semaphore>,
}

impl Default for App {
    fn default() -> Self {
        Self {
            runs: Arc::default(),
            entered: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        }
    }
}

impl App {
    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    pub fn open(&self) {
        self.gate.add_permits(Semaphore::MAX_PERMITS / 2);
    }
}

/// `POST /payments`: 201 with a fresh id, the body echoed, and a header of its own.
pub async fn pay(State(app): State<App>, headers: HeaderMap, body: Bytes) -> impl IntoResponse {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let user = headers
        .get("x-user")
        .map_or("anonymous".to_string(), |u| u.to_str().unwrap().to_string());
    let body = format!(
        r#"{{"id":"pay_{n}","user":"{user}","request":{}}}"#,
        String::from_utf8_lossy(&body)
    );
    (
        StatusCode::CREATED,
        [
            ("content-type", "application/json"),
            ("x-payment", "created"),
        ],
        body,
    )
}

/// `POST /slow`: waits at the gate, then pays.
pub async fn slow(State(app): State<App>, headers: HeaderMap, body: Bytes) -> impl IntoResponse {
    app.entered.notify_one();
    app.gate.acquire().await.unwrap().forget();
    pay(State(app), headers, body).await
}

/// `POST /flaky`: 500 on the first run, 201 after.
pub async fn flaky(State(app): State<App>) -> impl IntoResponse {
    if app.runs.fetch_add(1, Ordering::SeqCst) == 0 {
        (StatusCode::INTERNAL_SERVER_ERROR, "gateway down").into_response()
    } else {
        (StatusCode::CREATED, "paid").into_response()
    }
}

/// A body that says nothing of its length, as a stream does.
pub struct Streamed(Option<Bytes>);

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.take().map(|chunk| Ok(http_body::Frame::data(chunk))))
    }
}

/// `POST /stream`: 201 with a body of unknown length.
pub async fn stream(State(app): State<App>) -> axum::response::Response {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let body = axum::body::Body::new(Streamed(Some(Bytes::from(format!("chunk {n}")))));
    (StatusCode::CREATED, body).into_response()
}

/// `POST /whoami`: what the handler can read of the key and the claim.
pub async fn whoami(key: Option<Extension<IdempotencyKey>>) -> String {
    let attempt = idem_runtime::attempt().map(|a| a.key().to_hex());
    format!(
        "key={:?} attempt={}",
        key.map(|Extension(k)| k.as_str().to_string()),
        attempt.is_some()
    )
}

pub fn routes(app: &App) -> Router<()> {
    Router::new()
        .route("/payments", post(pay).get(pay).patch(pay))
        .route("/refunds", post(pay))
        .route("/slow", post(slow))
        .route("/flaky", post(flaky))
        .route("/whoami", post(whoami))
        .route("/stream", post(stream))
        .with_state(app.clone())
}

/// The layer every test starts from: keys scoped by the `x-user` header (an API key, in
/// effect), in a namespace of the test's own.
pub fn layer<St: Store + Clone>(
    store: St,
) -> IdempotencyLayer<St, impl idem_runtime::http::KeyScope> {
    IdempotencyLayer::new(store)
        .namespace(namespace("http"))
        .scope(|parts: &http::request::Parts| {
            parts
                .headers
                .get("x-user")
                .and_then(|u| u.to_str().ok())
                .map(str::to_string)
        })
}

/// Serves `router` on a free loopback port until the test ends.
pub async fn serve(router: Router<()>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    pub fn problem(&self) -> serde_json::Value {
        assert_eq!(
            self.headers["content-type"],
            "application/problem+json",
            "{}",
            String::from_utf8_lossy(&self.body)
        );
        let problem: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        for member in ["type", "title", "status", "detail"] {
            assert!(problem.get(member).is_some(), "no `{member}` in {problem}");
        }
        assert_eq!(problem["status"], self.status.as_u16());
        problem
    }

    /// The response as the handler made it: every header but the connection's `date`.
    pub fn same_as(&self, other: &Answer) -> bool {
        let headers = |a: &Answer| {
            let mut h: Vec<_> = a
                .headers
                .iter()
                .filter(|(name, _)| *name != "date" && *name != "idempotent-replayed")
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect();
            h.sort();
            h
        };
        self.status == other.status && self.body == other.body && headers(self) == headers(other)
    }
}

#[derive(Clone)]
pub struct Client_ {
    pub http: Client<HttpConnector, Full<Bytes>>,
    pub addr: SocketAddr,
}

impl Client_ {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            http: Client::builder(TokioExecutor::new()).build_http(),
            addr,
        }
    }

    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Answer {
        let mut request = http::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr));
        if !headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case("content-type"))
        {
            request = request.header("content-type", "application/json");
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
            .unwrap();
        let response = self.http.request(request).await.unwrap();
        let (parts, body) = response.into_parts();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }

    pub async fn post(&self, path: &str, key: &str, body: &str) -> Answer {
        self.send(
            Method::POST,
            path,
            &[("idempotency-key", key), ("x-user", "alice")],
            body,
        )
        .await
    }
}

pub async fn server_with<St: Store + Clone>(
    app: &App,
    layer: IdempotencyLayer<St, impl idem_runtime::http::KeyScope>,
) -> Client_ {
    Client_::new(serve(routes(app).layer(layer)).await)
}
