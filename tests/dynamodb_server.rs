//! The DynamoDB emulator the tests use: `IDEM_DYNAMODB_URL` (default `http://127.0.0.1:8000`,
//! where `.ci/run` starts `dynoxide`), started here when it is down and `dynoxide` is on the
//! `PATH`; and a client of it as a Lambda function's would be, less the TLS.

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
/// the SDK's standard retries (three attempts), sent again after 20 ms rather than up to a
/// second: the emulator is on this machine.
pub fn dynamodb_client(url: &str) -> aws_sdk_dynamodb::Client {
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .credentials_provider(Credentials::new("idem", "idem", None, None, "idem-tests"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .retry_config(RetryConfig::standard().with_initial_backoff(Duration::from_millis(20)))
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

/// Starts `dynoxide` on the default address, in memory, left running for the tests after
/// this one (as `.ci/run` would have): `false` when it cannot.
async fn start_dynoxide() -> bool {
    let started = std::process::Command::new("dynoxide")
        .args([
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "8000",
            "--log",
            "quiet",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    if started.is_err() {
        return false;
    }
    for _ in 0..100 {
        if answers("http://127.0.0.1:8000").await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The emulator's URL once it answers, or `None` (skipped) when it is down and cannot be
/// started here.
pub async fn dynamodb_endpoint() -> Option<String> {
    static UP: OnceCell<bool> = OnceCell::const_new();
    let url = dynamodb_url();
    let up = *UP
        .get_or_init(|| async {
            answers(&url).await
                || (std::env::var_os("IDEM_DYNAMODB_URL").is_none() && start_dynoxide().await)
        })
        .await;
    if up {
        Some(url)
    } else {
        unavailable(
            &format!("a DynamoDB endpoint at {url}"),
            "nothing answers there and `dynoxide` could not be started (`cargo install dynoxide-rs`, see README)",
        )
    }
}

/// A store on [`TABLE`] of the emulator, migrated, or `None` (skipped).
pub async fn dynamodb_store() -> Option<idem_runtime::DynamoDbStore> {
    static MIGRATED: OnceCell<()> = OnceCell::const_new();
    let url = dynamodb_endpoint().await?;
    let store = idem_runtime::DynamoDbStore::new(dynamodb_client(&url), TABLE);
    MIGRATED
        .get_or_init(|| async { store.migrate().await.expect("migrate the test table") })
        .await;
    Some(store)
}
