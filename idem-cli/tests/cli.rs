//! The `idem` command line, built, against a real PostgreSQL and Redis and the DynamoDB
//! emulator (`IDEM_DYNAMODB_URL`, default `http://127.0.0.1:8000`): the newcomer's 3 a.m. —
//! a body with a five-minute lease, its process SIGKILLed mid-body; `idem list` shows the
//! holder silent (its process exited), `idem release` frees the key, the retry runs at
//! once, and no effect happens beyond the killed body's and the retry's. The same against a
//! live holder is refused, and it completes alone. Also `show`, `reset`, `key`, the
//! confirmation and the exit codes.
//!
//! Skipped when a server is unreachable, unless `IDEM_REQUIRE_SERVICES=1`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::{DynamoDbStore, Error, Operation, Outcome, PostgresStore, RedisStore, Store};
use serde_json::Value;

/// Tells the child test what to run, and where.
const CHILD: &str = "IDEM_CLI_CHILD_TABLE";
const EFFECTS: &str = "IDEM_CLI_CHILD_EFFECTS";
const NAMESPACE: &str = "cli.charge.v1";

fn url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn redis_url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// The emulator's URL: the one [`dynamodb_store`] found or started (and gave the children
/// it spawns as `IDEM_DYNAMODB_URL`).
fn dynamodb_url() -> String {
    ENDPOINT
        .get()
        .cloned()
        .or_else(|| std::env::var("IDEM_DYNAMODB_URL").ok())
        .unwrap_or_else(|| "http://127.0.0.1:8000".into())
}

/// The emulator this process uses, once found: `IDEM_DYNAMODB_URL`, the one on
/// 127.0.0.1:8000, or one of this process's own (built when the machine has none).
static ENDPOINT: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The credentials the emulator takes, given to the child service and to `idem` alike.
const AWS_KEY: (&str, &str) = ("idem-cli", "idem-cli-secret");

/// A store, or `None` (skipped) when its server is unreachable and not required.
fn available<S>(what: &str, store: Result<S, Error>) -> Option<S> {
    match store {
        Ok(store) => Some(store),
        Err(err) if std::env::var_os("IDEM_REQUIRE_SERVICES").is_some() => {
            panic!("{what} is required: {err}")
        }
        Err(err) => {
            eprintln!("skipped: {what} is unavailable ({err})");
            None
        }
    }
}

async fn store(table: &str) -> Option<PostgresStore> {
    let store = PostgresStore::connect(&url()).await;
    available(
        "postgresql",
        store.and_then(|store| store.with_table(table)),
    )
}

async fn redis_store(prefix: &str) -> Option<RedisStore> {
    let store = RedisStore::connect(&redis_url()).await;
    available("redis", store.and_then(|store| store.with_prefix(prefix)))
}

/// A client of the emulator, over plain HTTP, with the credentials `idem` is given.
fn dynamodb_client() -> aws_sdk_dynamodb::Client {
    use aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(dynamodb_url())
        .credentials_provider(Credentials::new(AWS_KEY.0, AWS_KEY.1, None, None, "test"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    aws_sdk_dynamodb::Client::from_conf(config)
}

/// A DynamoDB store on `table`, made when missing, or `None` (skipped).
async fn dynamodb_store(table: &str) -> Option<DynamoDbStore> {
    let endpoint = idem_tests::dynamodb_endpoint().await?;
    let _ = ENDPOINT.set(endpoint);
    let store = DynamoDbStore::new(dynamodb_client(), table);
    let made = store.migrate().await.map(|()| store);
    available("the dynamodb emulator", made)
}

/// Where a test's records are: a table of its own in PostgreSQL or DynamoDB, or a key
/// prefix of its own in Redis.
#[derive(Clone, Debug)]
enum Place {
    Table(String),
    Prefix(String),
    Dynamo(String),
}

impl Place {
    /// The `--store` URL of the place.
    fn url(&self) -> String {
        match self {
            Self::Table(table) => format!("{}?table={table}", url()),
            Self::Prefix(prefix) => format!("{}/?prefix={prefix}", redis_url()),
            Self::Dynamo(table) => format!(
                "dynamodb:?table={table}&region=us-east-1&endpoint={}",
                dynamodb_url()
            ),
        }
    }

    /// How the child is told where to serve: `table:NAME` or `prefix:PREFIX`.
    fn spec(&self) -> String {
        match self {
            Self::Table(table) => format!("table:{table}"),
            Self::Prefix(prefix) => format!("prefix:{prefix}"),
            Self::Dynamo(table) => format!("dynamodb:{table}"),
        }
    }
}

fn operation() -> Operation {
    Operation::new(NAMESPACE).lease(Duration::from_secs(300))
}

/// One line appended to the effects file: what a body that charges does, outside the store.
fn effect(file: &Path, what: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .unwrap();
    writeln!(f, "{what}").unwrap();
    f.sync_all().unwrap();
}

/// The service, in a process of its own: claims key 7, makes its effect, says so, and
/// hangs until it is killed.
#[test]
fn child_service() {
    let (Ok(spec), Ok(effects)) = (std::env::var(CHILD), std::env::var(EFFECTS)) else {
        return; // only as the parent's child
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        match spec.split_once(':') {
            Some(("table", table)) => serve(store(table).await.unwrap(), &effects).await,
            Some(("prefix", prefix)) => serve(redis_store(prefix).await.unwrap(), &effects).await,
            Some(("dynamodb", table)) => {
                serve(DynamoDbStore::new(dynamodb_client(), table), &effects).await
            }
            Some(("webhook", rest)) => {
                let (table, id) = rest.split_once(':').unwrap();
                receive(store(table).await.unwrap(), id, &effects).await
            }
            _ => panic!("a child told to serve {spec:?}"),
        }
    });
}

/// The child's one call, on `store`.
async fn serve<S: Store + Clone>(store: S, effects: &str) {
    let op = operation();
    let key = op.key(&7_u32).unwrap();
    let ran = op
        .run(&store, &key, None, async {
            effect(Path::new(effects), "killed body");
            println!("\nthe service body started");
            std::future::pending::<Result<u32, Error>>().await
        })
        .await;
    // Only a failure gets here: its parent sees it end without a start.
    eprintln!("the service's call ended: {ran:?}");
}

/// The Standard Webhooks secret of the receiver below (`whsec_` and a key in base64).
const WEBHOOK_SECRET: &str = "whsec_Y2xpIHdlYmhvb2sgc2VjcmV0IGtleQ==";

/// A Standard Webhooks delivery of message `id`, signed now.
fn delivery(id: &str) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    use base64::Engine as _;
    use hmac::Mac as _;
    let engine = base64::engine::general_purpose::STANDARD;
    let key = engine
        .decode(WEBHOOK_SECRET.trim_start_matches("whsec_"))
        .unwrap();
    let body = r#"{"type":"invoice.paid"}"#;
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        .to_string();
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{id}.{t}.{body}").as_bytes());
    let signature = engine.encode(mac.finalize().into_bytes());
    http::Request::post("/webhooks/standard")
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", t)
        .header("webhook-signature", format!("v1,{signature}"))
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap()
}

/// The body a Standard Webhooks receiver's handler sees.
type Delivered = http::Request<
    http_body_util::Either<http_body_util::Full<bytes::Bytes>, http_body_util::Full<bytes::Bytes>>,
>;

/// A Standard Webhooks receiver on `store` (endpoint `cli`) whose handler runs `handler`.
fn receiver<S, F, Fut>(
    store: S,
    handler: F,
) -> impl tower::Service<
    http::Request<http_body_util::Full<bytes::Bytes>>,
    Response = http::Response<impl http_body::Body>,
    Error = std::convert::Infallible,
>
where
    S: Store + Clone,
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = &'static str> + Send + 'static,
{
    use idem_runtime::http::{IdempotencyLayer, Webhook};
    use tower::Layer as _;
    let preset = Webhook::standard(WEBHOOK_SECRET)
        .unwrap()
        .endpoint("cli")
        .unwrap();
    IdempotencyLayer::webhook(store, preset).layer(tower::service_fn(move |_: Delivered| {
        let handler = handler.clone();
        async move {
            let answer = handler().await;
            Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                bytes::Bytes::from(answer),
            )))
        }
    }))
}

/// The child's webhook receiver: delivery `id` comes in, its handler makes its effect,
/// says so, and hangs until the process is killed.
async fn receive<S: Store + Clone>(store: S, id: &str, effects: &str) {
    use tower::ServiceExt as _;
    let effects = effects.to_string();
    let service = receiver(store, move || {
        let effects = effects.clone();
        async move {
            effect(Path::new(&effects), "killed handler");
            println!("\nthe handler started");
            std::future::pending::<&'static str>().await
        }
    });
    let answered = service.oneshot(delivery(id)).await;
    eprintln!("the receiver answered: {:?}", answered.map(|r| r.status()));
}

/// Runs `idem` on `place` with `args`, its standard input empty (no terminal to confirm
/// on).
fn idem(place: &Place, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("--store")
        .arg(place.url())
        .args(args)
        .env("AWS_ACCESS_KEY_ID", AWS_KEY.0)
        .env("AWS_SECRET_ACCESS_KEY", AWS_KEY.1)
        .env_remove("AWS_SESSION_TOKEN")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn json(output: &Output) -> Value {
    assert!(
        output.status.success(),
        "{:?}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

fn fresh(test: &str) -> (String, PathBuf) {
    let id = format!(
        "{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let table = format!("cli_{test}_{id}");
    let effects = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{table}.effects"));
    (table, effects)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_is_seen_released_and_retried_at_once() {
    let (table, effects) = fresh("killed");
    let Some(store) = store(&table).await else {
        return;
    };
    store.migrate().await.unwrap();
    killed_holder(&store, &Place::Table(table.clone()), &effects).await;
    store.purge_expired().await.unwrap();
    drop_table(&store, &table).await;
}

/// The same on Redis: its records say whose they are too, and `idem` reaches them by URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_on_redis_is_seen_released_and_retried_at_once() {
    let (id, effects) = fresh("killed_redis");
    let prefix = format!("idem:{id}:");
    let Some(store) = redis_store(&prefix).await else {
        return;
    };
    killed_holder(&store, &Place::Prefix(prefix), &effects).await;
}

/// The same on DynamoDB, by table, region and endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_on_dynamodb_is_seen_released_and_retried_at_once() {
    let (table, effects) = fresh("killed_dynamodb");
    let Some(store) = dynamodb_store(&table).await else {
        return;
    };
    killed_holder(&store, &Place::Dynamo(table.clone()), &effects).await;
    dynamodb_client()
        .delete_table()
        .table_name(&table)
        .send()
        .await
        .unwrap();
}

/// The newcomer's scenario on `store`, which `place` names to `idem`.
async fn killed_holder<S: Store + Clone>(store: &S, place: &Place, effects: &Path) {
    // The service claims, makes its effect, and is SIGKILLed mid-body.
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_service",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, place.spec())
        .env(EFFECTS, effects)
        .env("IDEM_DYNAMODB_URL", dynamodb_url())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|line| line.is_ok_and(|line| line.ends_with("the service body started"))),
        "the service's body started"
    );
    let pid = child.id();
    child.kill().unwrap();
    child.wait().unwrap();

    // `list` shows the claim, its holder, and that the holder is silent: its process
    // exited, though its lease has minutes left.
    let page = json(&idem(
        place,
        &["--json", "list", "--namespace", "cli.", "--state", "held"],
    ));
    let entries = page["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{page}");
    let entry = &entries[0];
    assert_eq!(entry["namespace"], NAMESPACE);
    assert_eq!(entry["holder"]["pid"], pid);
    assert_eq!(entry["holder"]["exited"], true, "{entry}");
    assert_eq!(entry["silent"], true);
    assert_eq!(entry["lease_ms"], 300_000);
    assert!(entry["lease_left_ms"].as_u64().unwrap() > 60_000, "{entry}");
    let token = entry["token"].as_str().unwrap().to_string();

    // Without a terminal and without --yes: nothing is done.
    let unasked = idem(place, &["release", NAMESPACE, "7", "--token", &token]);
    assert_eq!(unasked.status.code(), Some(5));
    assert_eq!(
        json(&idem(place, &["--json", "show", NAMESPACE, "7"]))["state"],
        "held"
    );
    // Another token than the one shown: refused.
    let other = (token.parse::<u64>().unwrap() + 1_000).to_string();
    let stale = idem(
        place,
        &["release", NAMESPACE, "7", "--token", &other, "--yes"],
    );
    assert_eq!(
        stale.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&stale.stderr)
    );

    let released = idem(
        place,
        &["release", NAMESPACE, "7", "--token", &token, "--yes"],
    );
    assert!(
        released.status.success(),
        "{}",
        String::from_utf8_lossy(&released.stderr)
    );

    // The retry runs at once (no wait for the lease), and is recorded.
    let op = operation().wait(Duration::ZERO);
    let key = op.key(&7_u32).unwrap();
    let retried = op
        .run(store, &key, None, async {
            effect(effects, "retry");
            Ok::<_, Error>(7_u32)
        })
        .await
        .unwrap();
    assert_eq!(retried, Outcome::Executed(7));
    let done = json(&idem(place, &["--json", "show", NAMESPACE, "7"]));
    assert_eq!(done["state"], "completed");
    assert_eq!(done["value"], 7);
    // The killed body's effect and the retry's, nothing else.
    assert_eq!(
        std::fs::read_to_string(effects).unwrap(),
        "killed body\nretry\n"
    );

    // Reset: forgotten; `show` then finds nothing (exit 4), and the next call runs again.
    let digest = done["key"].as_str().unwrap().to_string();
    assert!(idem(place, &["reset", &digest, "--yes"]).status.success());
    assert_eq!(idem(place, &["show", &digest]).status.code(), Some(4));
    let _ = std::fs::remove_file(effects);
}

/// The operator's 3 a.m. with a webhook: a Standard Webhooks delivery whose receiver was
/// SIGKILLed mid-handler is found by the id the sender's dashboard shows (`idem show
/// --webhook standard msg_…`, the label the preset writes), released by it, and the
/// sender's retry runs at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_webhook_delivery_is_found_by_its_id_and_released() {
    use tower::ServiceExt as _;

    let (table, effects) = fresh("webhook");
    let Some(store) = store(&table).await else {
        return;
    };
    store.migrate().await.unwrap();
    let place = Place::Table(table.clone());
    let id = format!("msg_stuck_{}", std::process::id());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_service",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, format!("webhook:{table}:{id}"))
        .env(EFFECTS, &effects)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|line| line.is_ok_and(|line| line.ends_with("the handler started"))),
        "the receiver's handler started"
    );
    child.kill().unwrap();
    child.wait().unwrap();

    let shown = json(&idem(
        &place,
        &["--json", "show", "--webhook", "standard", &id],
    ));
    assert_eq!(shown["state"], "held", "{shown}");
    assert_eq!(shown["label"], id.as_str());
    assert_eq!(shown["namespace"], "idem.webhook.standard.cli");
    assert_eq!(shown["silent"], true, "its process exited: {shown}");
    let token = shown["token"].as_str().unwrap().to_string();
    // Another endpoint's name finds nothing; the listing shows the label.
    let elsewhere = idem(
        &place,
        &["show", "--webhook", "standard", "--endpoint", "other", &id],
    );
    assert_eq!(elsewhere.status.code(), Some(4));
    let listed = json(&idem(&place, &["--json", "list", "--label", &id]));
    assert_eq!(listed["entries"].as_array().unwrap().len(), 1, "{listed}");

    let released = idem(
        &place,
        &[
            "release",
            "--webhook",
            "standard",
            &id,
            "--token",
            &token,
            "--yes",
        ],
    );
    assert!(
        released.status.success(),
        "{}",
        String::from_utf8_lossy(&released.stderr)
    );
    // The sender's retry runs at once, and is recorded.
    let retry = receiver(store.clone(), || async { "retried" })
        .oneshot(delivery(&id))
        .await
        .unwrap();
    assert_eq!(retry.status(), http::StatusCode::OK);
    assert!(!retry.headers().contains_key("idempotent-replayed"));
    let done = json(&idem(
        &place,
        &["--json", "show", "--webhook", "standard", &id],
    ));
    assert_eq!(done["state"], "completed", "{done}");
    assert_eq!(
        std::fs::read_to_string(&effects).unwrap(),
        "killed handler\n"
    );
    let _ = std::fs::remove_file(&effects);
    drop_table(&store, &table).await;
}

/// A request through an HTTP layer is found by what its client sent: its `Idempotency-Key`
/// and the principal the layer's scope named. A call named by its namespace and digest is
/// found too, and refused under another namespace. A record completed by a claim made again
/// after its lease ran out lists under its namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_request_is_found_by_its_key_and_a_call_by_namespace_and_digest() {
    use idem_runtime::http::IdempotencyLayer;
    use tower::{Layer as _, ServiceExt as _};

    let (table, _) = fresh("http");
    let Some(store) = store(&table).await else {
        return;
    };
    store.migrate().await.unwrap();
    let place = Place::Table(table.clone());
    let layer = IdempotencyLayer::new(store.clone()).scope(|parts: &http::request::Parts| {
        parts
            .headers
            .get("x-user")
            .and_then(|user| user.to_str().ok())
            .map(str::to_owned)
    });
    let service = layer.layer(tower::service_fn(|_: Delivered| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
            bytes::Bytes::from_static(b"paid"),
        )))
    }));
    let request = http::Request::post("/payments")
        .header("idempotency-key", "k-1")
        .header("x-user", "alice")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
        .unwrap();
    let answer = service.oneshot(request).await.unwrap();
    assert_eq!(answer.status(), http::StatusCode::OK);

    let shown = json(&idem(
        &place,
        &["--json", "show", "--http", "k-1", "--scope", "alice"],
    ));
    assert_eq!(shown["state"], "completed", "{shown}");
    assert_eq!(shown["namespace"], "idem.http");
    // Another principal's key of that value is another request.
    let bob = idem(&place, &["show", "--http", "k-1", "--scope", "bob"]);
    assert_eq!(bob.status.code(), Some(4));
    // By namespace and digest; refused under a namespace the record does not have.
    let digest = shown["key"].as_str().unwrap();
    assert!(idem(&place, &["show", "idem.http", digest])
        .status
        .success());
    let wrong = idem(&place, &["show", "billing.v1", digest]);
    assert_eq!(wrong.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("of namespace idem.http"));
    drop_table(&store, &table).await;
}

/// A password in the store's URL is never printed: not by `--help` (the environment's
/// value is hidden), and not in an error that quotes the URL.
#[test]
fn the_stores_password_is_never_printed() {
    let secret = "hunter2-cli";
    let help = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("--help")
        .env(
            "IDEM_STORE",
            format!("postgres://app:{secret}@127.0.0.1:1/app"),
        )
        .output()
        .unwrap();
    assert!(help.status.success());
    assert!(!String::from_utf8_lossy(&help.stdout).contains(secret));
    for url in [
        format!("postgrex://app:{secret}@127.0.0.1:1/app"),
        format!("postgres://app:{secret}@127.0.0.1:1/app"),
        format!("redis://:{secret}@127.0.0.1:1/0"),
    ] {
        let failed = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["--store", &url, "list"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(failed.status.code(), Some(1), "{url}");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&failed.stdout),
            String::from_utf8_lossy(&failed.stderr)
        );
        assert!(!said.contains(secret), "{said}");
    }
}

#[test]
fn a_redis_url_naming_a_table_is_refused_not_ignored() {
    let refused = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--store", "redis://127.0.0.1:1/?table=orders", "list"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(1));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("?prefix="), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_holder_is_not_released_and_completes_alone() {
    let (table, _) = fresh("live");
    let place = Place::Table(table.clone());
    let Some(store) = store(&table).await else {
        return;
    };
    store.migrate().await.unwrap();
    let op = operation();
    let key = op.key(&8_u32).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let (started, has_started) = tokio::sync::oneshot::channel();
    let (go, wait) = tokio::sync::oneshot::channel::<()>();
    let holder = tokio::spawn({
        let (store, op, runs) = (store.clone(), op.clone(), runs.clone());
        async move {
            op.run(&store, &key, None, async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let _ = started.send(());
                let _ = wait.await;
                Ok::<_, Error>(8_u32)
            })
            .await
        }
    });
    has_started.await.unwrap();
    let shown = json(&idem(&place, &["--json", "show", NAMESPACE, "8"]));
    assert_eq!(shown["silent"], false, "{shown}");
    assert_eq!(shown["holder"]["exited"], false);
    let token = shown["token"].as_str().unwrap().to_string();
    let refused = idem(
        &place,
        &["release", NAMESPACE, "8", "--token", &token, "--yes"],
    );
    assert_eq!(refused.status.code(), Some(3));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("alive"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let reset = idem(&place, &["reset", NAMESPACE, "8", "--yes"]);
    assert_eq!(reset.status.code(), Some(3));
    go.send(()).unwrap();
    assert_eq!(holder.await.unwrap().unwrap(), Outcome::Executed(8));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        json(&idem(&place, &["--json", "show", NAMESPACE, "8"]))["value"],
        8
    );
    drop_table(&store, &table).await;
}

#[test]
fn key_prints_the_digest_the_macro_derives_and_refuses_ambiguous_json() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(args)
            .output()
            .unwrap()
    };
    let printed = run(&["key", NAMESPACE, r#"[17, "ada"]"#]);
    assert!(printed.status.success());
    let expected = idem_runtime::Key::derive(NAMESPACE, &(17_u32, "ada"))
        .unwrap()
        .to_hex();
    assert_eq!(String::from_utf8_lossy(&printed.stdout).trim(), expected);
    assert_eq!(
        String::from_utf8_lossy(&run(&["key", NAMESPACE, "-5"]).stdout).trim(),
        idem_runtime::Key::derive(NAMESPACE, &-5_i64)
            .unwrap()
            .to_hex()
    );
    // `-0` is the integer zero, as `0` is.
    assert_eq!(
        String::from_utf8_lossy(&run(&["key", NAMESPACE, "-0"]).stdout).trim(),
        idem_runtime::Key::derive(NAMESPACE, &0_u32)
            .unwrap()
            .to_hex()
    );
    for ambiguous in [
        "null",
        r#"{"id": 1}"#,
        "[1, null]",
        "123456789012345678901234",
    ] {
        let refused = run(&["key", NAMESPACE, ambiguous]);
        assert_eq!(refused.status.code(), Some(1), "{ambiguous}");
        assert!(!String::from_utf8_lossy(&refused.stderr).is_empty());
    }
    // No store given: a clear error, not a panic.
    let storeless = run(&["list"]);
    assert_eq!(storeless.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&storeless.stderr).contains("--store"));
}

/// Drops what `migrate` made for `table`.
async fn drop_table(store: &PostgresStore, table: &str) {
    sqlx::raw_sql(&format!(
        "DROP TABLE \"{table}\"; DROP SEQUENCE \"{table}_token\"; \
         DROP FUNCTION \"{table}_claim_in_transaction\""
    ))
    .execute(store.pool())
    .await
    .unwrap();
}

/// Two replicas of a service, each a `TieredStore` of its own memory over one PostgreSQL
/// table, replay a completed call from memory; `idem reset`, which speaks to PostgreSQL
/// alone, reaches both: once each has forgotten its copy (told by the server), the next
/// call runs the body, and the other replica replays the new value, never the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_the_memory_tier_of_every_replica() {
    use idem_runtime::{MemoryStore, TieredStore};

    let (table, _) = fresh("tiered");
    let (Some(a), Some(b)) = (store(&table).await, store(&table).await) else {
        return;
    };
    a.migrate().await.unwrap();
    let place = Place::Table(table.clone());
    let replicas = [
        TieredStore::new(MemoryStore::new(), a.clone()),
        TieredStore::new(MemoryStore::new(), b),
    ];
    let op = Operation::new(NAMESPACE);
    let key = op.key(&9_u32).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let call = |replica: &TieredStore<MemoryStore, PostgresStore>| {
        let (op, replica, runs) = (op.clone(), replica.clone(), Arc::clone(&runs));
        async move {
            op.run(&replica, &key, None, async move {
                Ok::<_, Error>(runs.fetch_add(1, Ordering::SeqCst) + 1)
            })
            .await
            .unwrap()
        }
    };
    assert_eq!(call(&replicas[0]).await, Outcome::Executed(1));
    for replica in &replicas {
        assert_eq!(call(replica).await, Outcome::Replayed(1));
        assert!(replica.fast().peek(&key).is_some(), "a copy in memory");
    }
    let reset = idem(&place, &["reset", NAMESPACE, "9", "--yes"]);
    assert!(
        reset.status.success(),
        "{}",
        String::from_utf8_lossy(&reset.stderr)
    );
    for replica in &replicas {
        // Each replica's own signal: its memory no longer holds the copy.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while replica.fast().peek(&key).is_some() {
            assert!(
                std::time::Instant::now() < deadline,
                "a replica kept its copy"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert_eq!(call(&replicas[1]).await, Outcome::Executed(2));
    assert_eq!(call(&replicas[0]).await, Outcome::Replayed(2));
    drop_table(&a, &table).await;
}
