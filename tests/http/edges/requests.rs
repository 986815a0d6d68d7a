//! Whether two requests are the same: principals the scope must read, and one key sent to
//! two endpoints.

use super::*;

/// The principal as an authentication layer would name it: the token of a `Bearer`
/// credential, read the way a hurried scope function reads it (case-sensitively).
fn bearer(parts: &Parts) -> Option<String> {
    let value = parts.headers.get("authorization")?.to_str().ok()?;
    value.strip_prefix("Bearer ").map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_request_whose_principal_is_unknown_is_refused_not_run_unprotected() {
    let app = App::default();
    let scoped = || {
        IdempotencyLayer::new(MemoryStore::new())
            .namespace(namespace("http.unknown"))
            .scope(bearer)
            .required()
    };
    let client = server_with(&app, scoped()).await;
    // A lower-case scheme (RFC 9110 allows it), and no credentials at all.
    for headers in [
        &[
            ("idempotency-key", "k"),
            ("authorization", "bearer tok_alice"),
        ][..],
        &[("idempotency-key", "k")][..],
    ] {
        for body in [r#"{"amount":1}"#, r#"{"amount":2}"#, r#"{"amount":1}"#] {
            let answer = client.send(Method::POST, "/payments", headers, body).await;
            assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
            assert!(answer.problem()["type"]
                .as_str()
                .unwrap()
                .ends_with("#principal-unknown"));
        }
    }
    assert_eq!(app.runs(), 0, "a request of unknown principal ran");
    // A known principal is served as ever, and a keyless request is still a 400.
    let known = [
        ("idempotency-key", "k"),
        ("authorization", "Bearer tok_alice"),
    ];
    let first = client.send(Method::POST, "/payments", &known, "{}").await;
    let again = client.send(Method::POST, "/payments", &known, "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(again.replayed());
    let keyless = client
        .send(
            Method::POST,
            "/payments",
            &[("authorization", "bearer x")],
            "{}",
        )
        .await;
    assert_eq!(keyless.status, StatusCode::BAD_REQUEST);
    assert_eq!(app.runs(), 1);

    // Pass-through, chosen out loud: each such request runs, and nothing is recorded.
    let app = App::default();
    let client = server_with(&app, scoped().pass_through_unknown_principal()).await;
    for _ in 0..3 {
        let answer = client
            .send(Method::POST, "/payments", &[("idempotency-key", "k")], "{}")
            .await;
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed());
    }
    assert_eq!(app.runs(), 3);
}

/// What an authentication layer puts on a request it accepted.
#[derive(Clone)]
struct Principal(String);

/// An authentication middleware: an `Authorization: Bearer` token names the principal.
async fn authenticate(mut request: Request, next: axum::middleware::Next) -> Response {
    let principal = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.get(..7)
                .filter(|s| s.eq_ignore_ascii_case("bearer "))
                .map(|_| v[7..].to_string())
        });
    match principal {
        Some(id) => {
            request.extensions_mut().insert(Principal(id));
            next.run(request).await
        }
        None => StatusCode::UNAUTHORIZED.into_response(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scope_reads_the_principal_an_outer_authentication_layer_set() {
    let idempotency = || {
        IdempotencyLayer::new(MemoryStore::new())
            .namespace(namespace("http.auth"))
            .scope(|parts: &Parts| parts.extensions.get::<Principal>().map(|p| p.0.clone()))
    };
    // Right: the authentication layer is added last, so it runs first.
    let app = App::default();
    let right = routes(&app)
        .layer(idempotency())
        .layer(axum::middleware::from_fn(authenticate));
    let client = Client_::new(serve(right).await);
    let as_user = |token: &'static str| [("idempotency-key", "k"), ("authorization", token)];
    let alice = client
        .send(Method::POST, "/payments", &as_user("bearer alice"), "{}")
        .await;
    let again = client
        .send(Method::POST, "/payments", &as_user("Bearer alice"), "{}")
        .await;
    let bob = client
        .send(Method::POST, "/payments", &as_user("Bearer bob"), "{}")
        .await;
    assert_eq!(alice.status, StatusCode::CREATED);
    assert!(again.replayed() && again.same_as(&alice));
    assert!(!bob.replayed(), "bob replayed alice's response");
    assert_eq!(app.runs(), 2);

    // Wrong: authentication inside the idempotency layer has not run when the scope asks.
    let app = App::default();
    let wrong = routes(&app)
        .layer(axum::middleware::from_fn(authenticate))
        .layer(idempotency());
    let client = Client_::new(serve(wrong).await);
    for _ in 0..3 {
        let answer = client
            .send(Method::POST, "/payments", &as_user("Bearer alice"), "{}")
            .await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(
        app.runs(),
        0,
        "the misplaced layer ran requests unprotected"
    );
}

/// Builds a router around an app's routes.
type Compose = Box<dyn Fn(&App) -> Router<()>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_sent_to_two_nested_endpoints_never_replays_one_for_the_other() {
    let store = MemoryStore::new();
    // Every layer in one namespace: the same key on the same store is the same key.
    let ns = namespace("http.nested");
    let in_ns = move |store: MemoryStore| {
        IdempotencyLayer::new(store)
            .namespace(ns.clone())
            .unscoped()
    };
    let shared = in_ns(store.clone());
    let compositions: Vec<(&str, Compose)> = vec![
        (
            "one layer cloned into two nests",
            Box::new(move |app: &App| {
                Router::new()
                    .nest("/v1", routes(app).layer(shared.clone()))
                    .nest("/v2", routes(app).layer(shared.clone()))
            }),
        ),
        (
            "a layer per nest on one store",
            Box::new({
                let (store, in_ns) = (store.clone(), in_ns.clone());
                move |app: &App| {
                    Router::new()
                        .nest("/v1", routes(app).layer(in_ns(store.clone())))
                        .nest("/v2", routes(app).layer(in_ns(store.clone())))
                }
            }),
        ),
        (
            "nest_service and a route layer",
            Box::new({
                let (store, in_ns) = (store.clone(), in_ns.clone());
                move |app: &App| {
                    Router::new()
                        .nest_service("/v1", routes(app).layer(in_ns(store.clone())))
                        .merge(
                            Router::new()
                                .nest("/v2", routes(app))
                                .route_layer(in_ns(store.clone())),
                        )
                }
            }),
        ),
    ];
    for (i, (how, compose)) in compositions.iter().enumerate() {
        let app = App::default();
        let client = Client_::new(serve(compose(&app)).await);
        let key = format!("nested-{i}");
        let v1 = client.post("/v1/payments", &key, r#"{"amount":5}"#).await;
        assert_eq!(v1.status, StatusCode::CREATED, "{how}");
        let v2 = client.post("/v2/payments", &key, r#"{"amount":5}"#).await;
        assert_eq!(
            v2.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{how}: /v2 answered from /v1's record"
        );
        // Each endpoint still replays its own.
        let v1_again = client.post("/v1/payments", &key, r#"{"amount":5}"#).await;
        assert!(v1_again.replayed() && v1_again.same_as(&v1), "{how}");
        assert_eq!(app.runs(), 1, "{how}");
    }
}
