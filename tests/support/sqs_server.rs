//! SQS for the tests: `IDEM_SQS_URL`, or moto's server of the test process's own on a free
//! port (`moto_server`, from PyPI's `moto[server]`: `.ci/run` installs it), which ends with
//! the process; and a client of it.

use std::time::Duration;

use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use tokio::sync::OnceCell;

use crate::unavailable;

/// A client of the SQS endpoint `url`, over plain HTTP, with credentials moto accepts.
pub fn sqs_client(url: &str) -> aws_sdk_sqs::Client {
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .credentials_provider(Credentials::new("idem", "idem", None, None, "idem-tests"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    aws_sdk_sqs::Client::from_conf(config)
}

/// The SQS endpoint, or `None` (skipped) when there is none: `IDEM_SQS_URL`, or a moto
/// server this process starts, once.
pub async fn sqs_endpoint() -> Option<String> {
    static UP: OnceCell<Result<String, String>> = OnceCell::const_new();
    let up = UP
        .get_or_init(|| async {
            match std::env::var("IDEM_SQS_URL") {
                Ok(url) => Ok(url),
                Err(_) => start_moto().await,
            }
        })
        .await;
    match up {
        Ok(url) => Some(url.clone()),
        Err(why) => unavailable("an SQS endpoint", why),
    }
}

/// Starts `moto_server` on a free port: its URL once it answers SQS.
async fn start_moto() -> Result<String, String> {
    let port = crate::free_port().ok_or("no free port")?.to_string();
    crate::tied::spawn(&["moto_server", "-H", "127.0.0.1", "-p", &port])
        .ok_or("`sh` could not be started")?;
    let url = format!("http://127.0.0.1:{port}");
    let client = sqs_client(&url);
    // Up to 60 s: moto is a Python program, slow to start on a loaded machine.
    for _ in 0..600 {
        if client.list_queues().send().await.is_ok() {
            return Ok(url);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err("`moto_server` did not answer within a minute (`pip install 'moto[server]'`)".into())
}
