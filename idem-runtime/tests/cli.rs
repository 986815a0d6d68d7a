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

fn dynamodb_url() -> String {
    std::env::var("IDEM_DYNAMODB_URL").unwrap_or_else(|_| "http://127.0.0.1:8000".into())
}

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
    let token = entry["token"].as_u64().unwrap().to_string();

    // Without a terminal and without --yes: nothing is done.
    let unasked = idem(place, &["release", NAMESPACE, "7", "--token", &token]);
    assert_eq!(unasked.status.code(), Some(5));
    assert_eq!(
        json(&idem(place, &["--json", "show", NAMESPACE, "7"]))["state"],
        "held"
    );
    // Another token than the one shown: refused.
    let other = (entry["token"].as_u64().unwrap() + 1_000).to_string();
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
    let token = shown["token"].as_u64().unwrap().to_string();
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
