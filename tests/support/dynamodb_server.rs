//! The DynamoDB emulator the tests use: `IDEM_DYNAMODB_URL` (default `http://127.0.0.1:8000`,
//! where `.ci/run` starts `dynoxide`), or, when nothing answers there, a `dynoxide` of the
//! test process's own that ends with it (built into `target/tools` by the first test that
//! needs it, when the machine has none: a first run on a fresh machine skips nothing); and
//! a client of it as a Lambda function's would be, less the TLS.

use std::time::Duration;

use aws_sdk_dynamodb::config::retry::RetryConfig;
use aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};
use tokio::sync::OnceCell;

use crate::unavailable;

/// The table every test store uses; keys are kept apart by namespaces.
pub const TABLE: &str = "idem_tests";

/// The emulator's URL: `IDEM_DYNAMODB_URL`, or `http://127.0.0.1:8000`.
pub fn dynamodb_url() -> String {
    std::env::var("IDEM_DYNAMODB_URL").unwrap_or_else(|_| "http://127.0.0.1:8000".into())
}

/// A client of the endpoint `url`, over plain HTTP, with credentials the emulator accepts and
/// the SDK's standard retries, sent again after 20 ms rather than up to a second: the
/// emulator is on this machine. Six attempts rather than three: the conformance proxy
/// throttles one request in 40 at random, so three in a row is one request in 64 000, and
/// the suite sends a few thousand (3 613 counted in one run): a run in twenty or so would
/// see one, and the store answers `Error::Store` then, as it must, failing a test that
/// needs the operation. Six in a row is one in four billion.
pub fn dynamodb_client(url: &str) -> aws_sdk_dynamodb::Client {
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .credentials_provider(Credentials::new("idem", "idem", None, None, "idem-tests"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .retry_config(
            RetryConfig::standard()
                .with_max_attempts(6)
                .with_initial_backoff(Duration::from_millis(20)),
        )
        .build();
    aws_sdk_dynamodb::Client::from_conf(config)
}

/// Whether something answers TCP at the URL's address.
async fn answers(url: &str) -> bool {
    let address = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::TcpStream::connect(address),
    )
    .await
    .is_ok_and(|connected| connected.is_ok())
}

/// The URL of the emulator this process started, if it started one: its child processes
/// are sent to it (`IDEM_DYNAMODB_URL`), since they share its tables.
static STARTED: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The emulator of this process's own, if it started one.
pub fn started_dynamodb_url() -> Option<&'static str> {
    STARTED.get().map(String::as_str)
}

/// Starts a `dynoxide` of this test process's own on a free port, in memory: its URL once
/// it answers, or `None` when it cannot be started. It lives as long as the process
/// ([`crate::tied`]).
async fn start_dynoxide() -> Option<String> {
    let dynoxide = dynoxide()?;
    let port = crate::free_port()?;
    let port = port.to_string();
    crate::tied::spawn(&[
        &dynoxide,
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        &port,
        "--log",
        "quiet",
    ])?;
    let url = format!("http://127.0.0.1:{port}");
    // Up to 30 s: a loaded machine starts it slowly, and a missing one is a failure in CI.
    for _ in 0..1_200 {
        if answers(&url).await {
            let _ = STARTED.set(url.clone());
            return Some(url);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    None
}

/// The version of the emulator the tests build when the machine has none: fixed, as
/// `.ci/run`'s, so that an emulator release cannot change what the tests prove.
const DYNOXIDE: &str = "3.2.0";

/// The `dynoxide` to run: the machine's (on `PATH`), or the one built into the workspace's
/// `target/tools` (by `cargo install --locked`, under a file lock, so that the test
/// processes that start at once build it once). `None` when it cannot be built.
fn dynoxide() -> Option<String> {
    use std::process::Command;
    let on_path = Command::new("dynoxide")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success());
    if on_path {
        return Some("dynoxide".to_owned());
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let root = target.join("tools");
    let built = root.join("bin").join("dynoxide");
    std::fs::create_dir_all(&root).ok()?;
    let lock = std::fs::File::create(root.join(".dynoxide.lock")).ok()?;
    lock.lock().ok()?;
    if !built.exists() {
        eprintln!(
            "building the DynamoDB emulator (dynoxide-rs {DYNOXIDE}) into {}, once",
            root.display()
        );
        let installed = Command::new(env!("CARGO"))
            .args([
                "install",
                "--locked",
                "--quiet",
                "dynoxide-rs",
                "--version",
                DYNOXIDE,
                "--no-default-features",
                "--features",
                "native-sqlite,http-server,cli",
                "--root",
            ])
            .arg(&root)
            .status()
            .is_ok_and(|status| status.success());
        if !installed {
            return None;
        }
    }
    Some(built.to_string_lossy().into_owned())
}

/// The emulator's URL once it answers (`IDEM_DYNAMODB_URL`; by default the one on
/// 127.0.0.1:8000, or, when nothing answers there, one of this process's own), or `None`
/// (skipped) when there is none and `dynoxide` cannot be started here.
pub async fn dynamodb_endpoint() -> Option<String> {
    static UP: OnceCell<Option<String>> = OnceCell::const_new();
    let url = dynamodb_url();
    let up = UP
        .get_or_init(|| async {
            if answers(&url).await {
                Some(url.clone())
            } else if std::env::var_os("IDEM_DYNAMODB_URL").is_none() {
                start_dynoxide().await
            } else {
                None
            }
        })
        .await;
    match up {
        Some(url) => Some(conformance(url).map_or_else(|| url.clone(), |(url, _)| url.clone())),
        None => unavailable(
            &format!("a DynamoDB endpoint at {url}"),
            "nothing answers there and `dynoxide` could be neither found nor built (`cargo install dynoxide-rs`)",
        ),
    }
}

/// The timeout of the stores [`dynamodb_store`] makes through the conformance proxy.
pub const CONFORMANCE_TIMEOUT: Duration = Duration::from_secs(10);

/// With `IDEM_DYNAMODB_CONFORMANCE=1`, the conformance proxy in front of `upstream`
/// (seeded by `IDEM_DYNAMODB_CONFORMANCE_SEED`, 1 by default): its URL and what it did.
/// One a process, started by the first test that asks.
pub fn conformance(
    upstream: &str,
) -> Option<&'static (
    String,
    std::sync::Arc<crate::dynamodb_conformance::Deviations>,
)> {
    static PROXY: std::sync::OnceLock<
        Option<(
            String,
            std::sync::Arc<crate::dynamodb_conformance::Deviations>,
        )>,
    > = std::sync::OnceLock::new();
    PROXY
        .get_or_init(|| {
            std::env::var_os("IDEM_DYNAMODB_CONFORMANCE")
                .filter(|on| on != "0")
                .map(|_| {
                    let seed = std::env::var("IDEM_DYNAMODB_CONFORMANCE_SEED")
                        .ok()
                        .and_then(|seed| seed.parse().ok())
                        .unwrap_or(1);
                    let proxy = crate::dynamodb_conformance::start(upstream.to_owned(), seed);
                    eprintln!(
                        "DynamoDB through the conformance proxy at {} (seed {seed})",
                        proxy.0
                    );
                    proxy
                })
        })
        .as_ref()
}

/// Whether the DynamoDB under test lacks `what` of AWS's documented behaviour, as
/// `IDEM_DYNAMODB_LACKS` says (comma-separated; none by default): `atomic` (a conditional
/// update is atomic, and one refused writes nothing: moto's are not, and up to 3 of 64
/// concurrent claims win there) or `capacity` (`ReturnConsumedCapacity` by AWS's sizing
/// rules: moto reports half a unit for every request). A test that needs it says so and is
/// skipped there.
pub fn dynamodb_lacks(what: &str) -> bool {
    let lacks = std::env::var("IDEM_DYNAMODB_LACKS").unwrap_or_default();
    let lacking = lacks.split(',').any(|lacked| lacked.trim() == what);
    if lacking {
        eprintln!(
            "skipped: this test needs {what}, which IDEM_DYNAMODB_LACKS says this DynamoDB lacks"
        );
    }
    lacking
}

/// A store on [`TABLE`] of the emulator, migrated, or `None` (skipped).
pub async fn dynamodb_store() -> Option<idem_runtime::DynamoDbStore> {
    static MIGRATED: OnceCell<()> = OnceCell::const_new();
    let url = dynamodb_endpoint().await?;
    let mut store = idem_runtime::DynamoDbStore::new(dynamodb_client(&url), TABLE);
    if conformance(&url).is_some() {
        // Through the proxy a request is a hop more, and an update two requests (it reads
        // the item first): on a loaded machine 3 s is too short for that, and a store that
        // times out fails closed, which a test of exactly-once then reads as a failure.
        store = store.with_timeout(CONFORMANCE_TIMEOUT);
    }
    MIGRATED
        .get_or_init(|| async { store.migrate().await.expect("migrate the test table") })
        .await;
    Some(store)
}
