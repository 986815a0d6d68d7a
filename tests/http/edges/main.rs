//! The `Idempotency-Key` layer where "the same request" and "the same principal" are hard
//! to tell, over real sockets: amounts that differ past a float's precision, principals the
//! scope cannot name, endpoints under nested routers, bodies of unknown length behind
//! compression, store failures, and headers that belong to one caller.//!
//! Here: amounts; `requests.rs`: principals and endpoints, what decides whether two requests
//! are the same; `responses.rs`: what is recorded and replayed of an answer (streams,
//! compression, problem bodies, outages, cookies).

#[path = "../support.rs"]
mod support;

mod blips;
mod requests;
mod responses;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::request::Parts;
use idem_runtime::http::{IdempotencyLayer, Unrecorded};
use idem_runtime::{Error, InFlight, MemoryStore, Store};
use idem_tests::scenarios::namespace;
use idem_tests::{Down, Probe, DOWN};
use support::*;
use tokio::sync::mpsc;

/// A layer with one key space for every client, in a namespace of the test's own.
fn unscoped<St: Store + Clone>(
    store: St,
) -> IdempotencyLayer<St, impl idem_runtime::http::KeyScope> {
    IdempotencyLayer::new(store)
        .namespace(namespace("http.edges"))
        .unscoped()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_amount_that_differs_past_a_floats_precision_is_never_replayed() {
    let app = App::default();
    let client = server_with(&app, layer(MemoryStore::new())).await;
    let different = [
        ("18446744073709551617", "18446744073709551616"),
        ("99.999999999999999999", "100.0"),
        ("0.1", "0.10000000000000000001"),
        ("100000000000000000000001", "100000000000000000000000"),
        ("1e23", "99999999999999991611392"),
        ("-0.5", "0.5"),
    ];
    // One key per pair: the first amount is recorded, the second sent as a retry.
    let amounts = |key: String, first: &'static str, second: &'static str| {
        let client = client.clone();
        async move {
            let body = |amount: &str| format!(r#"{{"amount":{amount}}}"#);
            let recorded = client.post("/payments", &key, &body(first)).await;
            assert_eq!(recorded.status, StatusCode::CREATED);
            let retry = client.post("/payments", &key, &body(second)).await;
            (recorded, retry)
        }
    };
    for (i, &(first, second)) in different.iter().enumerate() {
        let (_, other) = amounts(format!("differ-{i}"), first, second).await;
        assert_eq!(
            other.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{second} replayed the response recorded for {first}"
        );
    }
    assert_eq!(app.runs(), different.len());

    // Spellings of one value are one payload.
    let same = [
        ("1", "1.0"),
        ("1", "1e0"),
        ("1", "10e-1"),
        ("100", "1e2"),
        ("1.5", "15E-1"),
    ];
    for (i, &(first, second)) in same.iter().enumerate() {
        let (recorded, retry) = amounts(format!("same-{i}"), first, second).await;
        assert!(
            retry.replayed() && retry.same_as(&recorded),
            "{second} is {first}: {}",
            retry.status
        );
    }
    assert_eq!(app.runs(), different.len() + same.len());
}
