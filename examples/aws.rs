//! The DynamoDB client configurations of the Lambda examples: from the environment Lambda
//! sets, and for the emulator their demos run against.

use aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};

/// The SDK's configuration from the environment Lambda sets, over HTTPS (rustls on ring).
pub fn lambda_config() -> aws_sdk_dynamodb::Config {
    use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};

    let var = |name: &str| std::env::var(name).unwrap_or_default();
    let https = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
        .build_https();
    aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(var("AWS_REGION")))
        .credentials_provider(Credentials::new(
            var("AWS_ACCESS_KEY_ID"),
            var("AWS_SECRET_ACCESS_KEY"),
            std::env::var("AWS_SESSION_TOKEN").ok(),
            None,
            "lambda-environment",
        ))
        .http_client(https)
        .build()
}

/// The emulator's configuration: plain HTTP, any credentials.
pub fn emulator_config(url: &str) -> aws_sdk_dynamodb::Config {
    aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .credentials_provider(Credentials::new("demo", "demo", None, None, "demo"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build()
}
