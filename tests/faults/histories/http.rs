//! Histories through the HTTP layer: requests with `Idempotency-Key` over real sockets to
//! an axum service whose store fails, loses answers and slows down by a seeded schedule.
//! Each response is read back as the answer it stands for (`201` its handler's value, a
//! replay, a problem's variant, the handler's own `500`, a response marked
//! `Idempotent-Unrecorded`), and the history is held to the same rules as a call's.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use idem_runtime::http::{IdempotencyLayer, IDEMPOTENT_REPLAYED, IDEMPOTENT_UNRECORDED};
use idem_runtime::testkit::{Answer, Faults, Faulty, History};
use idem_runtime::{MemoryStore, Store};
use idem_tests::scenarios::namespace;
use idem_tests::{postgres_store, redis_store};

use super::{calls, seeds};

#[path = "../../http/support.rs"]
#[allow(unused_imports)]
mod support;

/// The handler: a body of the history, named by the request's `x-call`; `x-fails: 1`
/// makes it answer its own `500` (not recorded: the key is released).
async fn order(State(history): State<History>, headers: HeaderMap) -> impl IntoResponse {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let call = header("x-call")
        .and_then(|v| v.parse().ok())
        .expect("x-call");
    let body = history.body_started(call);
    tokio::task::yield_now().await;
    if header("x-fails") == Some("1") {
        history.body_ended(body, Err(()));
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            "the handler failed".to_string(),
        );
    }
    history.body_ended(body, Ok(body));
    (StatusCode::CREATED, body.to_string())
}

/// What `answer` stands for.
fn read(answer: &support::Answer) -> Answer {
    let text = String::from_utf8_lossy(&answer.body);
    let marked = |name: &str| answer.headers.get(name).is_some_and(|v| v == "true");
    let problem = answer
        .headers
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json");
    match answer.status {
        StatusCode::CREATED if marked(IDEMPOTENT_UNRECORDED) => Answer::Failed("unrecorded"),
        StatusCode::CREATED if marked(IDEMPOTENT_REPLAYED) => {
            Answer::Replayed(text.parse().expect("a body id"))
        }
        StatusCode::CREATED => Answer::Executed(text.parse().expect("a body id")),
        StatusCode::INTERNAL_SERVER_ERROR if !problem => Answer::BodyFailed,
        _ => {
            let kind = answer.problem()["type"]
                .as_str()
                .and_then(|t| t.rsplit('#').next())
                .unwrap_or_default()
                .to_string();
            Answer::Failed(match kind.as_str() {
                "in-flight" => "in_progress",
                "key-reused" => "payload_mismatch",
                "gone" => "gone",
                "store-unavailable" => "store",
                "unrecorded" => "unrecorded",
                "internal" => "codec",
                other => panic!("an answer the history does not expect: {other} ({text})"),
            })
        }
    }
}

async fn run<S: Store + Clone>(label: &str, base: u64, store: S) {
    const LEASE: Duration = Duration::from_millis(300);
    for seed in seeds(base) {
        let faulty = Faulty::new(store.clone(), seed, Faults::ten_percent());
        let history = History::new();
        let layer = IdempotencyLayer::new(faulty.clone())
            .namespace(namespace(&format!("histories.http.{seed}")))
            .unscoped()
            .lease(LEASE);
        let router = Router::new()
            .route("/orders", post(order))
            .with_state(history.clone())
            .layer(layer);
        let client = support::Client_::new(support::serve(router).await);
        // The store's timeout, a wait for a duplicate and the record's retries, each at
        // most a lease or the timeout, and time for a loaded machine.
        let timeout = store.claim_timeout().unwrap_or(Duration::from_secs(3));
        let bound = timeout * 2 + LEASE * 3 + Duration::from_secs(10);
        let (callers, per_caller) = (20, (calls() / 4 / 20).max(1));
        let keys = (calls() / 40).max(1) as u64;
        let mut tasks = tokio::task::JoinSet::new();
        for caller in 0..callers {
            let (client, history) = (client.clone(), history.clone());
            let mut rng = seed.wrapping_mul(31).wrapping_add(caller);
            tasks.spawn(async move {
                for _ in 0..per_caller {
                    // A small LCG is enough to spread keys, payloads and failures.
                    rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    let draw = rng >> 33;
                    let key = draw % keys;
                    let payload = u64::from((draw >> 12) % 50 == 0);
                    let fails = if (draw >> 20) % 20 == 0 { "1" } else { "0" };
                    let call = history.begin(key, payload, bound);
                    let answer = client
                        .send(
                            http::Method::POST,
                            "/orders",
                            &[
                                ("idempotency-key", &format!("order-{key}")),
                                ("x-call", &call.to_string()),
                                ("x-fails", fails),
                            ],
                            &format!(r#"{{"payload":{payload}}}"#),
                        )
                        .await;
                    history.end(call, read(&answer));
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.unwrap();
        }
        match history.check() {
            Ok(mut report) => {
                report.faults = faulty.injected();
                println!("http on {label}: seed {seed}: {report}");
            }
            Err(violation) => panic!("http on {label}, seed {seed}: {violation}"),
        }
        assert!(faulty.injected() > 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_on_memory() {
    run("memory", 11, MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_on_redis() {
    let Some(store) = redis_store().await else {
        return;
    };
    run("redis", 12, store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_on_postgres() {
    let Some(store) = postgres_store().await else {
        return;
    };
    run("postgres", 13, Arc::new(store) as Arc<dyn Store>).await;
}
