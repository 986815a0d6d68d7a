//! A proxy between the SDK and the emulator that answers within the letter of AWS's
//! documentation, where it leaves a choice, unlike `dynoxide` does: so that the store
//! depends on what DynamoDB promises, not on one emulator.
//!
//! `IDEM_DYNAMODB_CONFORMANCE=1` puts it in front of every test's DynamoDB
//! ([`dynamodb_endpoint`](crate::dynamodb_endpoint)); `.ci/run` runs the DynamoDB suite and
//! the DynamoDB histories through it. What it does, each with the documentation it rests on:
//!
//! - **`UPDATED_NEW` without what an update left unchanged.** `UpdateItem` "returns only the
//!   updated attributes, as they appear after the UpdateItem operation"; whether one set to
//!   the value it had counts is not said (moto leaves it out). The proxy reads the item
//!   before the update and leaves out of the reply every attribute whose value is the one
//!   it had.
//! - **A failed condition without the item, one time in two.** The item comes back only
//!   "if the condition check fails" and `ReturnValuesOnConditionCheckFailure` is `ALL_OLD`;
//!   an endpoint that does not support it answers without one.
//! - **Throttling, one request in 40**, before the emulator sees it:
//!   `ProvisionedThroughputExceededException` or `ThrottlingException`, both of which AWS
//!   says to retry with backoff (the SDK does).
//! - **`UpdateTimeToLive` once a table an hour**: "Any additional UpdateTimeToLive calls for
//!   the same table during this one hour duration result in a ValidationException."
//! - **`DescribeTable` that does not find a table just created**, once a table: it "uses an
//!   eventually consistent query", and just after `CreateTable` "DynamoDB might return a
//!   ResourceNotFoundException".
//!
//! A reply lost after its write landed is not among them: the store then waits out its
//! timeout, which would move the timing the suite's crash tests measure.
//! `tests/stores/dynamodb.rs` loses replies through a proxy of its own, in a test of its own.
//!
//! The proxy reads items of its own with the headers of the request it serves (the
//! emulator does not check signatures). It runs on a thread and a runtime of its own, so
//! that it outlives each test's runtime; its choices are seeded, its counts printed.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use serde_json::Value;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Upstream = Client<HttpConnector, Full<Bytes>>;
type Answer = http::Response<Full<Bytes>>;

/// What the proxy did, counted.
#[derive(Debug, Default)]
pub struct Deviations {
    pub forwarded: AtomicUsize,
    pub unchanged_dropped: AtomicUsize,
    pub items_omitted: AtomicUsize,
    pub throttled: AtomicUsize,
    pub ttl_refused: AtomicUsize,
    pub tables_not_found: AtomicUsize,
}

impl Deviations {
    fn count(counter: &AtomicUsize) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

struct Proxy {
    client: Upstream,
    upstream: String,
    rng: Mutex<XorShiftRng>,
    /// Tables whose TTL was changed (no second change within the hour).
    ttl_changed: Mutex<HashSet<String>>,
    /// Tables created and not yet described (the first description does not find them).
    created: Mutex<HashSet<String>>,
    done: Arc<Deviations>,
}

/// Starts a proxy in front of `upstream` whose choices follow `seed`: its URL, and what it
/// did.
pub fn start(upstream: String, seed: u64) -> (String, Arc<Deviations>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let done = Arc::new(Deviations::default());
    let proxy = Arc::new(Proxy {
        client: Client::builder(TokioExecutor::new()).build_http(),
        upstream,
        rng: Mutex::new(XorShiftRng::seed_from_u64(seed)),
        ttl_changed: Mutex::default(),
        created: Mutex::default(),
        done: Arc::clone(&done),
    });
    std::thread::Builder::new()
        .name("dynamodb-conformance".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let proxy = Arc::clone(&proxy);
                    let service = hyper::service::service_fn(move |request| {
                        Arc::clone(&proxy).serve(request)
                    });
                    tokio::spawn(async move {
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            });
        })
        .unwrap();
    (url, done)
}

/// An error answer as DynamoDB gives one: `400`, its type and message in JSON.
fn error(kind: &str, message: &str) -> Answer {
    let body = serde_json::json!({
        "__type": format!("com.amazonaws.dynamodb.v20120810#{kind}"),
        "message": message,
    });
    http::Response::builder()
        .status(400)
        .header("content-type", "application/x-amz-json-1.0")
        .body(Full::new(serde_json::to_vec(&body).unwrap().into()))
        .unwrap()
}

impl Proxy {
    /// One in `n`, by the seed.
    fn one_in(&self, n: u32) -> bool {
        self.rng.lock().unwrap().random_range(0..n) == 0
    }

    async fn serve(
        self: Arc<Self>,
        request: http::Request<hyper::body::Incoming>,
    ) -> Result<Answer, BoxError> {
        let (parts, body) = request.into_parts();
        let body = body.collect().await?.to_bytes();
        let operation = parts
            .headers
            .get("x-amz-target")
            .and_then(|target| target.to_str().ok())
            .and_then(|target| target.strip_prefix("DynamoDB_20120810."))
            .unwrap_or("")
            .to_owned();
        let asked: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let table = asked["TableName"].as_str().unwrap_or("").to_owned();

        if self.one_in(40) {
            Deviations::count(&self.done.throttled);
            return Ok(if self.one_in(2) {
                error(
                    "ProvisionedThroughputExceededException",
                    "The level of configured provisioned throughput for the table was exceeded.",
                )
            } else {
                error(
                    "ThrottlingException",
                    "Rate of requests exceeds the allowed throughput.",
                )
            });
        }
        match operation.as_str() {
            "UpdateTimeToLive" if !self.ttl_changed.lock().unwrap().insert(table.clone()) => {
                Deviations::count(&self.done.ttl_refused);
                return Ok(error(
                    "ValidationException",
                    "Time to live has been modified multiple times within a fixed interval",
                ));
            }
            "DescribeTable" if self.created.lock().unwrap().remove(&table) => {
                Deviations::count(&self.done.tables_not_found);
                return Ok(error(
                    "ResourceNotFoundException",
                    &format!("Requested resource not found: Table: {table} not found"),
                ));
            }
            _ => {}
        }
        // The item before an update that asks for what it changed.
        let before = if operation == "UpdateItem" && asked["ReturnValues"] == "UPDATED_NEW" {
            let read = serde_json::json!({
                "TableName": table,
                "Key": asked["Key"],
                "ConsistentRead": true,
            });
            let (_, item) = self
                .send(&parts, "GetItem", read.to_string().into())
                .await?;
            serde_json::from_slice::<Value>(&item)
                .ok()
                .map(|read| read["Item"].clone())
        } else {
            None
        };
        let (mut answer, mut reply) = self.send(&parts, &operation, body).await?;
        Deviations::count(&self.done.forwarded);
        let mut changed = false;
        if let Ok(mut replied) = serde_json::from_slice::<Value>(&reply) {
            if let (Some(before), Some(attributes)) =
                (before, replied["Attributes"].as_object_mut())
            {
                let unchanged: Vec<String> = attributes
                    .iter()
                    .filter(|(name, value)| before.get(name.as_str()) == Some(*value))
                    .map(|(name, _)| name.clone())
                    .collect();
                for name in unchanged {
                    attributes.remove(&name);
                    Deviations::count(&self.done.unchanged_dropped);
                    changed = true;
                }
            }
            let failed_condition = replied["__type"]
                .as_str()
                .is_some_and(|kind| kind.ends_with("ConditionalCheckFailedException"));
            if failed_condition && replied.get("Item").is_some() && self.one_in(2) {
                replied.as_object_mut().unwrap().remove("Item");
                Deviations::count(&self.done.items_omitted);
                changed = true;
            }
            if changed {
                reply = serde_json::to_vec(&replied).unwrap().into();
            }
        }
        if changed {
            answer.headers.remove(http::header::CONTENT_LENGTH);
            answer.headers.remove("x-amz-crc32");
        }
        if operation == "CreateTable" && answer.status.is_success() {
            self.created.lock().unwrap().insert(table);
        }
        Ok(http::Response::from_parts(answer, Full::new(reply)))
    }

    /// Sends `body` as `operation` to the emulator, with the headers of `parts`.
    async fn send(
        &self,
        parts: &http::request::Parts,
        operation: &str,
        body: Bytes,
    ) -> Result<(http::response::Parts, Bytes), BoxError> {
        let mut request = http::Request::builder()
            .method(parts.method.clone())
            .uri(format!("{}/", self.upstream));
        for (name, value) in &parts.headers {
            if name != http::header::CONTENT_LENGTH
                && name != http::header::HOST
                && name.as_str() != "x-amz-target"
            {
                request = request.header(name, value);
            }
        }
        let request = request
            .header("x-amz-target", format!("DynamoDB_20120810.{operation}"))
            .body(Full::new(body))?;
        let answer = self.client.request(request).await?;
        let (parts, body) = answer.into_parts();
        Ok((parts, body.collect().await?.to_bytes()))
    }
}
