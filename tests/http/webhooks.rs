//! Keys where the sender puts them, and webhook receivers: signatures checked before any
//! claim, one run per delivery, duplicates answered `2xx`.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::{Method, StatusCode};
use axum::routing::post;
use axum::Router;
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use bytes::Bytes;
use hmac::{Hmac, Mac};
use idem_runtime::admin::{Admin, Filter};
use idem_runtime::http::{IdempotencyLayer, KeyFrom, Webhook};
use idem_runtime::{MemoryStore, Store};
use idem_tests::postgres_store;
use idem_tests::scenarios::namespace;
use sha2::Sha256;
use support::*;
use tokio::sync::Barrier;

fn mac(secret: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).unwrap();
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().to_vec()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A unique id for this run, so that records of earlier runs in a shared store never answer.
fn unique(prefix: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}_{nanos}")
}

/// A receiver whose handler counts its runs and answers `200` with the run's number.
fn receiver(runs: &Arc<AtomicUsize>) -> Router<()> {
    let runs = Arc::clone(runs);
    Router::new().route(
        "/hooks",
        post(move |body: Bytes| {
            let runs = Arc::clone(&runs);
            async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                format!("credited {n} ({} bytes)", body.len())
            }
        }),
    )
}

async fn serve_receiver<St: Store + Clone>(
    runs: &Arc<AtomicUsize>,
    layer: IdempotencyLayer<St, impl idem_runtime::http::KeyScope>,
) -> Client_ {
    Client_::new(serve(receiver(runs).layer(layer)).await)
}

/// Stripe's signature header for `body` signed at `t`.
fn stripe_signature(secret: &str, t: u64, body: &str) -> String {
    let signed = mac(
        secret.as_bytes(),
        &[t.to_string().as_bytes(), b".", body.as_bytes()],
    );
    format!("t={t},v1={}", hex::encode(signed))
}

/// GitHub's headers for one hook's delivery of `body`.
fn github_headers(secret: &str, hook: &str, delivery: &str, body: &str) -> Vec<(String, String)> {
    vec![
        ("x-github-hook-id".into(), hook.into()),
        ("x-github-delivery".into(), delivery.into()),
        ("x-github-event".into(), "push".into()),
        (
            "x-hub-signature-256".into(),
            format!(
                "sha256={}",
                hex::encode(mac(secret.as_bytes(), &[body.as_bytes()]))
            ),
        ),
    ]
}

async fn deliver(client: &Client_, headers: &[(String, String)], body: &str) -> Answer {
    let headers: Vec<(&str, &str)> = headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    client.send(Method::POST, "/hooks", &headers, body).await
}

async fn records_under(store: &MemoryStore, prefix: &str) -> usize {
    store
        .list(&Filter::namespace(prefix), None)
        .await
        .unwrap()
        .entries()
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_the_body_replays_resends_and_its_problems_name_it() {
    let runs = Arc::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .namespace(namespace("body-key"))
        .unscoped()
        .required()
        .key_from(KeyFrom::json("/id"));
    let client = serve_receiver(&runs, layer).await;
    let event = r#"{"id":"evt_1","amount":100}"#;
    let first = client.send(Method::POST, "/hooks", &[], event).await;
    assert_eq!(first.status, StatusCode::OK);
    // The resend carries no `Idempotency-Key`, and is the same event.
    let resend = client
        .send(
            Method::POST,
            "/hooks",
            &[],
            r#"{ "amount": 100, "id": "evt_1" }"#,
        )
        .await;
    assert!(resend.replayed() && resend.same_as(&first));
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let other = client
        .send(
            Method::POST,
            "/hooks",
            &[],
            r#"{"id":"evt_1","amount":999}"#,
        )
        .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    let problem = other.problem();
    let text = problem.to_string();
    assert!(text.contains("the body's `/id`"), "{text}");
    assert!(!text.contains("Idempotency-Key"), "{text}");

    let missing = client
        .send(Method::POST, "/hooks", &[], r#"{"amount":1}"#)
        .await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    let text = missing.problem().to_string();
    assert!(
        text.contains("the body's `/id`") && !text.contains("Idempotency-Key"),
        "{text}"
    );
    let malformed = client
        .send(Method::POST, "/hooks", &[], r#"{"id":{"nested":1}}"#)
        .await;
    assert_eq!(malformed.status, StatusCode::BAD_REQUEST);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_body_key_passes_through_with_its_body() {
    let runs = Arc::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .namespace(namespace("body-key-optional"))
        .unscoped()
        .key_from(KeyFrom::json("/id"));
    let client = serve_receiver(&runs, layer).await;
    for _ in 0..2 {
        let answer = client
            .send(Method::POST, "/hooks", &[], r#"{"amount":1}"#)
            .await;
        assert_eq!(answer.status, StatusCode::OK);
        assert!(!answer.replayed());
        // The handler got the whole body the layer read.
        assert!(
            String::from_utf8_lossy(&answer.body).contains("(12 bytes)"),
            "{:?}",
            answer.body
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_or_unsigned_delivery_is_a_401_and_claims_nothing() {
    let runs = Arc::default();
    let store = MemoryStore::new();
    let secret = "It's a Secret to Everybody";
    let client = serve_receiver(
        &runs,
        IdempotencyLayer::webhook(store.clone(), Webhook::github(secret).unwrap()),
    )
    .await;
    let body = r#"{"ref":"refs/heads/main"}"#;
    let delivery = unique("delivery");

    let forged = github_headers("not the secret", "7", &delivery, body);
    let unsigned: Vec<_> = forged
        .iter()
        .filter(|(name, _)| name != "x-hub-signature-256")
        .cloned()
        .collect();
    let mut tampered = github_headers(secret, "7", &delivery, body);
    tampered.retain(|(name, _)| name != "x-hub-signature-256");
    tampered.push((
        "x-hub-signature-256".into(),
        format!("sha256={}", hex::encode(mac(secret.as_bytes(), &[b"{}"]))),
    ));
    for headers in [&forged, &unsigned, &tampered] {
        let answer = deliver(&client, headers, body).await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
        let problem = answer.problem();
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with("#signature-invalid"),
            "{problem}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(
        records_under(&store, "idem.webhook.").await,
        0,
        "a record was left"
    );

    // The real delivery of that id, after the forgeries, runs.
    let real = deliver(&client, &github_headers(secret, "7", &delivery, body), body).await;
    assert_eq!(real.status, StatusCode::OK);
    assert!(!real.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(records_under(&store, "idem.webhook.github").await, 1);
}

/// GitHub signs the body and nothing else, so the key is what the signature vouches for:
/// the event's kind and the body. A captured delivery sent again under a new
/// `X-GitHub-Delivery` is replayed, not run again; an old signed body sent under the id of
/// a delivery still on its way takes nothing from it: the real delivery runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_github_body_is_its_key_whatever_delivery_id_comes_with_it() {
    let runs = Arc::default();
    let secret = "hook secret";
    let store = MemoryStore::new();
    let client = serve_receiver(
        &runs,
        IdempotencyLayer::webhook(store.clone(), Webhook::github(secret).unwrap()),
    )
    .await;
    let old = r#"{"action":"opened","number":1}"#;
    let first = deliver(
        &client,
        &github_headers(secret, "7", &unique("d"), old),
        old,
    )
    .await;
    assert_eq!(first.status, StatusCode::OK);
    assert!(!first.replayed());
    // Captured, and sent again under a delivery id of the attacker's choosing.
    let captured = deliver(
        &client,
        &github_headers(secret, "7", &unique("d"), old),
        old,
    )
    .await;
    assert!(
        captured.replayed() && captured.same_as(&first),
        "{captured:?}"
    );
    // The old body under the id of a new delivery, sent before it arrives...
    let next = unique("d");
    let taken = deliver(&client, &github_headers(secret, "7", &next, old), old).await;
    assert!(taken.replayed() && taken.same_as(&first), "{taken:?}");
    // ...and the real delivery of that id runs.
    let new = r#"{"action":"closed","number":1}"#;
    let real = deliver(&client, &github_headers(secret, "7", &next, new), new).await;
    assert_eq!(real.status, StatusCode::OK, "{real:?}");
    assert!(!real.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // The claims are labelled with the delivery's id, for an operator.
    let page = store
        .list(&Filter::namespace("idem.webhook.github."), None)
        .await
        .unwrap();
    let labels: Vec<_> = page.entries().iter().filter_map(|e| e.label()).collect();
    assert!(labels.contains(&next.as_str()), "{labels:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_resends_run_once_and_all_answer_2xx() {
    let runs = Arc::default();
    let store = MemoryStore::new();
    let secret = "whsec_concurrent";
    // Two receivers on one store: two replicas of a service.
    let replicas = [
        serve_receiver(
            &runs,
            IdempotencyLayer::webhook(store.clone(), Webhook::stripe(secret).unwrap()),
        )
        .await,
        serve_receiver(
            &runs,
            IdempotencyLayer::webhook(store.clone(), Webhook::stripe(secret).unwrap()),
        )
        .await,
    ];
    let event = format!(r#"{{"id":"{}","type":"charge.succeeded"}}"#, unique("evt"));
    let resends = 16;
    let barrier = Arc::new(Barrier::new(resends));
    let mut tasks = Vec::new();
    for i in 0..resends {
        let client = replicas[i % 2].clone();
        let (barrier, event) = (Arc::clone(&barrier), event.clone());
        tasks.push(tokio::spawn(async move {
            let headers = [(
                "stripe-signature".to_string(),
                stripe_signature(secret, now(), &event),
            )];
            barrier.wait().await;
            deliver(&client, &headers, &event).await
        }));
    }
    let mut bodies = Vec::new();
    for task in tasks {
        let answer = task.await.unwrap();
        assert!(answer.status.is_success(), "{answer:?}");
        bodies.push(answer.body);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(
        bodies.iter().all(|b| *b == bodies[0]),
        "every resend gets the one answer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_resends_with_another_pending_count_replay_and_stale_signatures_are_refused() {
    let runs = Arc::default();
    let secret = "whsec_stripe";
    let client = serve_receiver(
        &runs,
        IdempotencyLayer::webhook(MemoryStore::new(), Webhook::stripe(secret).unwrap()),
    )
    .await;
    let id = unique("evt");
    let event = |pending: u32, amount: u32| {
        format!(
            r#"{{"id":"{id}","pending_webhooks":{pending},"data":{{"object":{{"amount":{amount}}}}}}}"#
        )
    };
    let send = |body: String, t: u64| {
        let client = client.clone();
        async move {
            let headers = [(
                "stripe-signature".to_string(),
                stripe_signature(secret, t, &body),
            )];
            deliver(&client, &headers, &body).await
        }
    };
    let first = send(event(2, 500), now()).await;
    assert_eq!(first.status, StatusCode::OK);
    let resend = send(event(1, 500), now()).await;
    assert!(resend.replayed() && resend.same_as(&first), "{resend:?}");
    let changed = send(event(1, 501), now()).await;
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(changed.problem().to_string().contains("the body's `/id`"));
    // Captured and sent again ten minutes later: past the five-minute tolerance.
    let stale = send(event(2, 500), now() - 600).await;
    assert_eq!(stale.status, StatusCode::UNAUTHORIZED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_webhooks_and_shopify_deliveries_run_once() {
    let runs = Arc::default();
    let key = b"a standard webhooks key";
    let standard_secret = format!("whsec_{}", BASE64.encode(key));
    let standard = serve_receiver(
        &runs,
        IdempotencyLayer::webhook(
            MemoryStore::new(),
            Webhook::standard(&standard_secret).unwrap(),
        ),
    )
    .await;
    let id = unique("msg");
    let body = r#"{"type":"invoice.paid"}"#;
    let signed = |t: u64| standard_headers(key, &id, t, body, "webhook");
    let first = deliver(&standard, &signed(now()), body).await;
    assert_eq!(first.status, StatusCode::OK);
    // A retry is signed again, at its own time: the same delivery.
    let retry = deliver(&standard, &signed(now() + 1), body).await;
    assert!(retry.replayed() && retry.same_as(&first));

    let shopify_secret = "shpss_secret";
    let shopify = serve_receiver(
        &runs,
        IdempotencyLayer::webhook(
            MemoryStore::new(),
            Webhook::shopify(shopify_secret).unwrap(),
        ),
    )
    .await;
    let webhook_id = unique("shopify");
    let order = r#"{"id":820982911946154508}"#;
    let headers = vec![
        ("x-shopify-webhook-id".to_string(), webhook_id),
        ("x-shopify-event-id".to_string(), "e-1".to_string()),
        (
            "x-shopify-hmac-sha256".to_string(),
            BASE64.encode(mac(shopify_secret.as_bytes(), &[order.as_bytes()])),
        ),
    ];
    let first = deliver(&shopify, &headers, order).await;
    assert_eq!(first.status, StatusCode::OK);
    let again = deliver(&shopify, &headers, order).await;
    assert!(again.replayed());
    // A resend of the same order under another webhook id (Shopify signs the body only):
    // the same delivery.
    let mut renamed = headers.clone();
    renamed[0].1 = unique("shopify");
    let renamed = deliver(&shopify, &renamed, order).await;
    assert!(renamed.replayed() && renamed.same_as(&first), "{renamed:?}");
    // Another topic is another event, even with the same body.
    let mut updated = headers.clone();
    updated.push(("x-shopify-topic".to_string(), "orders/updated".to_string()));
    let updated = deliver(&shopify, &updated, order).await;
    assert_eq!(updated.status, StatusCode::OK);
    assert!(!updated.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_whose_response_was_not_kept_is_answered_200_not_410() {
    let runs = Arc::default();
    let secret = "s";
    let client = serve_receiver(
        &runs,
        // Every response of this handler is over the recording limit.
        IdempotencyLayer::webhook(MemoryStore::new(), Webhook::github(secret).unwrap())
            .max_recorded_body(4),
    )
    .await;
    let body = "{}";
    let headers = github_headers(secret, "1", &unique("d"), body);
    let first = deliver(&client, &headers, body).await;
    assert_eq!(first.status, StatusCode::OK);
    let again = deliver(&client, &headers, body).await;
    assert_eq!(again.status, StatusCode::OK, "{again:?}");
    assert!(again.replayed());
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler never runs twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_on_postgres_run_once_across_two_receivers() {
    let Some(store) = postgres_store().await else {
        return;
    };
    let runs = Arc::default();
    let secret = "pg secret";
    let namespace = namespace("webhook-pg");
    let layer = || {
        IdempotencyLayer::webhook(store.clone(), Webhook::github(secret).unwrap())
            .namespace(namespace.clone())
    };
    let replicas = [
        serve_receiver(&runs, layer()).await,
        serve_receiver(&runs, layer()).await,
    ];
    let body = r#"{"zen":"Keep it logically awesome."}"#;
    let delivery = unique("delivery");
    let mut answers = Vec::new();
    for round in 0..4 {
        let headers = github_headers(secret, "9", &delivery, body);
        answers.push(deliver(&replicas[round % 2], &headers, body).await);
    }
    assert!(answers.iter().all(|a| a.status == StatusCode::OK));
    for answer in &answers[1..] {
        assert!(
            answer.replayed() && answer.same_as(&answers[0]),
            "{answer:?} after {:?}",
            answers[0]
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_extractor_reads_the_source_in_the_request_extensions() {
    use axum::Extension;
    use idem_runtime::http::IdempotencyKey;

    async fn shown(key: IdempotencyKey) -> String {
        key.as_str().to_string()
    }
    let from_headers = Router::new()
        .route("/hooks", post(shown))
        .layer(Extension(KeyFrom::headers(["x-hook", "x-delivery"])));
    let client = Client_::new(serve(from_headers).await);
    let both = client
        .send(
            Method::POST,
            "/hooks",
            &[("x-hook", "7"), ("x-delivery", "d-1")],
            "{}",
        )
        .await;
    assert_eq!(both.status, StatusCode::OK);
    assert_eq!(both.body, "7/d-1");
    // The header it no longer reads is not a key; the missing one is named.
    let header_only = client
        .send(
            Method::POST,
            "/hooks",
            &[("idempotency-key", "k-1"), ("x-hook", "7")],
            "{}",
        )
        .await;
    assert_eq!(header_only.status, StatusCode::BAD_REQUEST);
    let text = header_only.problem().to_string();
    assert!(text.contains("`x-hook` and `x-delivery`"), "{text}");

    // A body source cannot be read from the head: a misconfiguration, answered 500.
    let from_body = Router::new()
        .route("/hooks", post(shown))
        .layer(Extension(KeyFrom::json("/id")));
    let client = Client_::new(serve(from_body).await);
    let answer = client
        .send(Method::POST, "/hooks", &[], r#"{"id":"e"}"#)
        .await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    answer.problem();
}

/// What the transactional receivers below write: one credit row per run of their claim.
async fn credits_table(pool: &sqlx::PgPool) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.tests.webhook_tx_credits'))")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE IF NOT EXISTS webhook_tx_credits (delivery text NOT NULL)")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// Credits a delivery once: the claim of its key, the row and the record commit in `tx`.
#[idem_runtime::idempotent(key = key, store = store, transaction = tx, namespace = "tests.webhook.tx.v1")]
async fn credit_once(
    key: &idem_runtime::IdempotencyKey,
    store: &idem_runtime::PostgresStore,
    tx: &mut sqlx::PgConnection,
) -> Result<String, idem_runtime::Error> {
    sqlx::query("INSERT INTO webhook_tx_credits (delivery) VALUES ($1)")
        .bind(key.as_str())
        .execute(&mut *tx)
        .await
        .map_err(idem_runtime::Error::store)?;
    Ok(format!("credited {key}"))
}

/// The receiver's handler: the key the preset found, a transaction, the credit, the commit.
async fn credit_in_transaction(
    axum::extract::State(store): axum::extract::State<idem_runtime::PostgresStore>,
    key: idem_runtime::IdempotencyKey,
) -> Result<idem_runtime::Outcome<String>, idem_runtime::Error> {
    let mut tx = store
        .pool()
        .begin()
        .await
        .map_err(idem_runtime::Error::store)?;
    let credited = credit_once_outcome(&key, &store, &mut tx).await?;
    tx.commit().await.map_err(idem_runtime::Error::store)?;
    Ok(credited)
}

/// A preset used as a layer of its own checks the signature of every request first (a
/// forged, an unsigned and a `GET` one are answered `401`, and the handler never runs),
/// finds the delivery's id where the sender puts it (in the body for Stripe, two headers
/// for GitHub), and hands it to the handler's `IdempotencyKey` extractor; the handler
/// claims it in its own PostgreSQL transaction. Resends, concurrent ones too, credit once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preset_as_a_layer_hands_the_handler_the_delivery_key_to_claim_in_its_transaction() {
    let Some(store) = postgres_store().await else {
        return;
    };
    let pool = store.pool().clone();
    credits_table(&pool).await;
    let (stripe_secret, github_secret) = ("whsec_tx", "github tx secret");
    let app = Router::new()
        .route(
            "/stripe",
            post(credit_in_transaction).layer(Webhook::stripe(stripe_secret).unwrap()),
        )
        .route(
            "/github",
            post(credit_in_transaction).layer(Webhook::github(github_secret).unwrap()),
        )
        .with_state(store);
    let client = Client_::new(serve(app).await);
    let credits = |delivery: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM webhook_tx_credits WHERE delivery = $1",
            )
            .bind(delivery)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };

    let event = unique("evt_tx");
    let body = format!(r#"{{"id":"{event}","type":"charge.succeeded"}}"#);
    let signed = stripe_signature(stripe_secret, now(), &body);
    let send = |method: Method, signature: Option<String>, body: String| {
        let client = client.clone();
        async move {
            let headers: Vec<(&str, &str)> = signature
                .as_deref()
                .map(|s| vec![("stripe-signature", s)])
                .unwrap_or_default();
            client.send(method, "/stripe", &headers, &body).await
        }
    };
    let forged = stripe_signature("whsec_guessed", now(), &body);
    for (method, signature) in [
        (Method::POST, Some(forged)),
        (Method::POST, None),
        (Method::GET, None),
    ] {
        let answer = send(method.clone(), signature, body.clone()).await;
        assert_eq!(
            answer.status,
            StatusCode::UNAUTHORIZED,
            "{method} {answer:?}"
        );
        assert!(answer.problem()["type"]
            .as_str()
            .unwrap()
            .ends_with("#signature-invalid"));
    }
    assert_eq!(
        credits(event.clone()).await,
        0,
        "nothing ran for an unsigned delivery"
    );

    let first = send(Method::POST, Some(signed.clone()), body.clone()).await;
    assert_eq!(first.status, StatusCode::OK, "{first:?}");
    assert_eq!(first.body, format!("credited {event}").as_bytes());
    let resends = futures_util::future::join_all(
        (0..6).map(|_| send(Method::POST, Some(signed.clone()), body.clone())),
    )
    .await;
    for resend in &resends {
        assert_eq!(resend.status, StatusCode::OK, "{resend:?}");
        assert!(resend.replayed(), "a resend is a replay: {resend:?}");
    }
    assert_eq!(credits(event.clone()).await, 1, "the event credited once");

    let unkeyed = r#"{"type":"charge.succeeded"}"#;
    let answer = send(
        Method::POST,
        Some(stripe_signature(stripe_secret, now(), unkeyed)),
        unkeyed.to_owned(),
    )
    .await;
    assert_eq!(
        answer.status,
        StatusCode::BAD_REQUEST,
        "a signed delivery without its id"
    );

    // GitHub: the key is the event's kind and the signed body, whatever delivery id comes
    // with it: two deliveries of one body credit once, another body once more.
    let body = format!(r#"{{"action":"created","id":"{}"}}"#, unique("gh"));
    let other = format!(r#"{{"action":"deleted","id":"{}"}}"#, unique("gh"));
    for body in [&body, &body, &other] {
        let headers = github_headers(github_secret, "1", &unique("delivery"), body);
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let answer = client.send(Method::POST, "/github", &headers, body).await;
        assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    }
    for body in [&body, &other] {
        use sha2::Digest as _;
        let key = format!("push/{}", hex::encode(Sha256::digest(body.as_bytes())));
        assert_eq!(credits(key).await, 1, "{body}");
    }
}

/// Standard Webhooks' headers for `body` signed with `key` at `t`, under the
/// specification's names (`webhook-*`) or Svix's (`svix-*`).
fn standard_headers(
    key: &[u8],
    id: &str,
    t: u64,
    body: &str,
    names: &str,
) -> Vec<(String, String)> {
    let signature = mac(
        key,
        &[
            id.as_bytes(),
            b".",
            t.to_string().as_bytes(),
            b".",
            body.as_bytes(),
        ],
    );
    vec![
        (format!("{names}-id"), id.to_string()),
        (format!("{names}-timestamp"), t.to_string()),
        (
            format!("{names}-signature"),
            format!("v1,{}", BASE64.encode(signature)),
        ),
    ]
}

/// Two endpoints of one sender, each with its own secret, on one store: the sender sends
/// one event id to both, and each runs it once (and replays its own answer); a named
/// endpoint whose secret is rotated keeps its records.
async fn two_endpoints_of_each_sender<St: Store + Clone>(store: St) {
    // Stripe: two endpoints, unnamed (known by their secrets).
    let stripe_runs: [Arc<AtomicUsize>; 2] = Default::default();
    let secrets = [unique("whsec_a"), unique("whsec_b")];
    let mut endpoints = Vec::new();
    for (runs, secret) in stripe_runs.iter().zip(&secrets) {
        let layer = IdempotencyLayer::webhook(store.clone(), Webhook::stripe(secret).unwrap());
        endpoints.push(serve_receiver(runs, layer).await);
    }
    let event = format!(r#"{{"id":"{}","type":"charge.succeeded"}}"#, unique("evt"));
    for round in 0..2 {
        for (client, secret) in endpoints.iter().zip(&secrets) {
            let headers = [(
                "stripe-signature".to_string(),
                stripe_signature(secret, now(), &event),
            )];
            let answer = deliver(client, &headers, &event).await;
            assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
            assert_eq!(answer.replayed(), round == 1, "{answer:?}");
        }
    }
    for runs in &stripe_runs {
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "each endpoint ran the event once"
        );
    }

    // Standard Webhooks: two named endpoints; one message id to both.
    let standard_runs: [Arc<AtomicUsize>; 2] = Default::default();
    let keys = [unique("key-a").into_bytes(), unique("key-b").into_bytes()];
    let names = [unique("orders"), unique("audit")];
    let mut endpoints = Vec::new();
    for ((runs, key), name) in standard_runs.iter().zip(&keys).zip(&names) {
        let preset = Webhook::standard(&format!("whsec_{}", BASE64.encode(key)))
            .unwrap()
            .endpoint(name)
            .unwrap();
        endpoints
            .push(serve_receiver(runs, IdempotencyLayer::webhook(store.clone(), preset)).await);
    }
    let id = unique("msg");
    let body = r#"{"type":"invoice.paid"}"#;
    for round in 0..2 {
        for (client, key) in endpoints.iter().zip(&keys) {
            let answer = deliver(
                client,
                &standard_headers(key, &id, now(), body, "webhook"),
                body,
            )
            .await;
            assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
            assert_eq!(answer.replayed(), round == 1, "{answer:?}");
        }
    }
    for runs in &standard_runs {
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "each endpoint ran the message once"
        );
    }

    // The first endpoint's secret is rotated: the new secret, the same name, the records
    // kept. A resend signed with the new secret replays.
    let rotated = unique("key-rotated").into_bytes();
    let preset = Webhook::standard(&format!("whsec_{}", BASE64.encode(&rotated)))
        .unwrap()
        .endpoint(&names[0])
        .unwrap();
    let after = serve_receiver(
        &standard_runs[0],
        IdempotencyLayer::webhook(store.clone(), preset),
    )
    .await;
    let answer = deliver(
        &after,
        &standard_headers(&rotated, &id, now(), body, "webhook"),
        body,
    )
    .await;
    assert!(answer.replayed(), "{answer:?}");
    assert_eq!(standard_runs[0].load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_endpoints_of_one_sender_on_postgres_each_run_each_event_once() {
    let Some(store) = postgres_store().await else {
        return;
    };
    two_endpoints_of_each_sender(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_endpoints_of_one_sender_on_redis_each_run_each_event_once() {
    let Some(store) = idem_tests::redis_store().await else {
        return;
    };
    two_endpoints_of_each_sender(store).await;
}

/// Svix sends `svix-id`, `svix-timestamp` and `svix-signature` unless its customer pays for
/// the specification's names: the preset takes both, and the key is the id either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn svix_default_headers_are_verified_and_keyed() {
    let runs = Arc::default();
    let key = b"a svix endpoint key";
    let preset = Webhook::standard(&format!("whsec_{}", BASE64.encode(key))).unwrap();
    let client = serve_receiver(&runs, IdempotencyLayer::webhook(MemoryStore::new(), preset)).await;
    let id = unique("msg");
    let body = r#"{"type":"user.created"}"#;
    let first = deliver(
        &client,
        &standard_headers(key, &id, now(), body, "svix"),
        body,
    )
    .await;
    assert_eq!(first.status, StatusCode::OK, "{first:?}");
    // Svix's retry is signed again; the specification's names for the same message too.
    let retry = deliver(
        &client,
        &standard_headers(key, &id, now() + 2, body, "svix"),
        body,
    )
    .await;
    assert!(retry.replayed() && retry.same_as(&first), "{retry:?}");
    let spelled = deliver(
        &client,
        &standard_headers(key, &id, now(), body, "webhook"),
        body,
    )
    .await;
    assert!(spelled.replayed(), "{spelled:?}");
    // A forged Svix signature is refused like any other.
    let forged = deliver(
        &client,
        &standard_headers(b"guessed", &id, now(), body, "svix"),
        body,
    )
    .await;
    assert_eq!(forged.status, StatusCode::UNAUTHORIZED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A captured Svix delivery sent again with an unsigned id of the other spelling beside its
/// signed one (`webhook-id: …`, no `webhook-signature`) is keyed by the id its signature
/// vouches for: replayed, never run as a new delivery. Nor is a delivery whose one spelling
/// signs and whose other spelling only carries a new id, the other way round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsigned_id_of_the_other_spelling_is_never_the_key() {
    let runs = Arc::default();
    let key = b"a re-headered endpoint key";
    let preset = Webhook::standard(&format!("whsec_{}", BASE64.encode(key))).unwrap();
    let client = serve_receiver(&runs, IdempotencyLayer::webhook(MemoryStore::new(), preset)).await;
    let body = r#"{"type":"invoice.paid"}"#;
    for (signed, other) in [("svix", "webhook"), ("webhook", "svix")] {
        let id = unique("msg");
        let captured = standard_headers(key, &id, now(), body, signed);
        let first = deliver(&client, &captured, body).await;
        assert_eq!(first.status, StatusCode::OK, "{first:?}");
        let mut reheadered = captured.clone();
        reheadered.push((format!("{other}-id"), unique("msg_new")));
        reheadered.push((format!("{other}-timestamp"), now().to_string()));
        let again = deliver(&client, &reheadered, body).await;
        assert!(again.replayed() && again.same_as(&first), "{again:?}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Behind the webhook layer, a handler that takes the `IdempotencyKey` extractor gets the
/// key the layer found (in the body, for Stripe), not a `400` for a missing header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extractor_behind_the_webhook_layer_gets_the_delivery_key() {
    use idem_runtime::IdempotencyKey;

    async fn shown(key: IdempotencyKey) -> String {
        format!("key {key}")
    }
    let secret = "whsec_extractor";
    let app = Router::new()
        .route("/hooks", post(shown))
        .layer(IdempotencyLayer::webhook(
            MemoryStore::new(),
            Webhook::stripe(secret).unwrap(),
        ));
    let client = Client_::new(serve(app).await);
    let event = unique("evt");
    let body = format!(r#"{{"id":"{event}"}}"#);
    let headers = [(
        "stripe-signature".to_string(),
        stripe_signature(secret, now(), &body),
    )];
    let answer = deliver(&client, &headers, &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert_eq!(answer.body, format!("key {event}").as_bytes());
}

/// A webhook layer verifies a request of every method: an unsigned `GET`, `PUT` or
/// `DELETE` is a `401` and never reaches the handler; a signed one reaches it unclaimed
/// (only `POST` deliveries are claimed), and leaves no record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_layer_verifies_every_method() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let secret = "every method";
    let store = MemoryStore::new();
    let app = Router::new()
        .route(
            "/hooks",
            axum::routing::any(move || {
                let runs = Arc::clone(&counted);
                async move { format!("ran {}", runs.fetch_add(1, Ordering::SeqCst) + 1) }
            }),
        )
        .layer(IdempotencyLayer::webhook(
            store.clone(),
            Webhook::github(secret).unwrap(),
        ));
    let client = Client_::new(serve(app).await);
    let body = r#"{"zen":"Approachable is better than simple."}"#;
    for method in [Method::GET, Method::PUT, Method::DELETE, Method::POST] {
        let answer = client.send(method.clone(), "/hooks", &[], body).await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED, "{method}");
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "no unsigned request reached the handler"
    );
    let headers = github_headers(secret, "1", &unique("d"), body);
    let headers: Vec<(&str, &str)> = headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    for _ in 0..2 {
        let answer = client.send(Method::PUT, "/hooks", &headers, body).await;
        assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
        assert!(!answer.replayed());
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "a signed PUT passes, unclaimed"
    );
    assert_eq!(records_under(&store, "idem.webhook.").await, 0);
}

/// Stripe's `pending_webhooks` changes between resends of one event: it is left out of
/// the fingerprint whatever `Content-Type` the delivery is sent with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_pending_webhooks_is_left_out_whatever_the_content_type() {
    let runs = Arc::default();
    let secret = "whsec_ctype";
    let client = serve_receiver(
        &runs,
        IdempotencyLayer::webhook(MemoryStore::new(), Webhook::stripe(secret).unwrap()),
    )
    .await;
    let id = unique("evt");
    let event = |pending: u32| format!(r#"{{"id":"{id}","pending_webhooks":{pending}}}"#);
    let mut answers = Vec::new();
    for (pending, content_type) in [
        (3, "text/plain"),
        (2, "application/octet-stream"),
        (1, "text/plain"),
    ] {
        let body = event(pending);
        let headers = [
            (
                "stripe-signature".to_string(),
                stripe_signature(secret, now(), &body),
            ),
            ("content-type".to_string(), content_type.to_string()),
        ];
        answers.push(deliver(&client, &headers, &body).await);
    }
    assert_eq!(answers[0].status, StatusCode::OK);
    for answer in &answers[1..] {
        assert!(
            answer.replayed() && answer.same_as(&answers[0]),
            "{answer:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A duplicate of a delivery still running is answered within the sender's timeout however
/// long the lease: under a five-minute lease, a `409` with `Retry-After` after the preset's
/// wait, never five minutes: 8 s for Stripe (whose timeout is longer), 4 s for Shopify
/// (whose timeout is 5 s). On tokio's paused clock, so the wait is measured exactly however
/// loaded the machine.
#[tokio::test(start_paused = true)]
async fn a_duplicate_under_a_five_minute_lease_is_answered_within_ten_seconds() {
    let secret = "whsec_patience";
    let body = format!(r#"{{"id":"{}"}}"#, unique("evt"));
    let signature = stripe_signature(secret, now(), &body);
    let waited = duplicate_waits(
        Webhook::stripe(secret).unwrap(),
        &[("stripe-signature", &signature)],
        &body,
    )
    .await;
    assert_eq!(waited, std::time::Duration::from_secs(8));
}

#[tokio::test(start_paused = true)]
async fn a_shopify_duplicate_is_answered_within_shopifys_five_second_timeout() {
    let secret = "shpss_patience";
    let body = format!(r#"{{"id":"{}"}}"#, unique("order"));
    let signature = BASE64.encode(mac(secret.as_bytes(), &[body.as_bytes()]));
    let waited = duplicate_waits(
        Webhook::shopify(secret).unwrap(),
        &[
            ("x-shopify-hmac-sha256", &signature),
            ("x-shopify-topic", "orders/create"),
            ("x-shopify-webhook-id", "w-1"),
        ],
        &body,
    )
    .await;
    assert!(
        waited < std::time::Duration::from_secs(5),
        "the duplicate waited {waited:?}"
    );
}

/// How long a duplicate of a delivery whose handler is still running waits, under a
/// five-minute lease, before it is answered `409` with `Retry-After`.
async fn duplicate_waits(
    preset: Webhook,
    headers: &[(&str, &str)],
    body: &str,
) -> std::time::Duration {
    use tower::ServiceExt as _;

    let (started_tx, started) = tokio::sync::mpsc::unbounded_channel::<()>();
    let release = Arc::new(tokio::sync::Notify::new());
    let held = Arc::clone(&release);
    let app = Router::new()
        .route(
            "/hooks",
            post(move || {
                let (started, held) = (started_tx.clone(), Arc::clone(&held));
                async move {
                    let _ = started.send(());
                    held.notified().await;
                    "done"
                }
            }),
        )
        .layer(
            IdempotencyLayer::webhook(MemoryStore::new(), preset)
                .lease(std::time::Duration::from_secs(300)),
        );
    let request = || {
        let mut request = http::Request::post("/hooks").header("content-type", "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request
            .body(axum::body::Body::from(body.to_owned()))
            .unwrap()
    };
    let first = tokio::spawn(app.clone().oneshot(request()));
    let mut started = started;
    started.recv().await.unwrap();
    let begun = tokio::time::Instant::now();
    let duplicate = app.clone().oneshot(request()).await.unwrap();
    let waited = begun.elapsed();
    assert_eq!(duplicate.status(), StatusCode::CONFLICT);
    assert!(duplicate.headers().contains_key("retry-after"));
    release.notify_one();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    waited
}
