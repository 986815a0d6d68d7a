//! A store, by its URL.

use idem_runtime::admin::Admin;
#[cfg(feature = "dynamodb")]
use idem_runtime::DynamoDbStore;
#[cfg(feature = "mysql")]
use idem_runtime::MySqlStore;
#[cfg(feature = "postgres")]
use idem_runtime::PostgresStore;
#[cfg(feature = "sqlite")]
use idem_runtime::SqliteStore;
#[cfg(feature = "redis")]
use idem_runtime::{RedisStore, TieredStore};

use crate::{failure, Failure};

/// The store of `url`, behind the shared fast tier of `fast` if one is named (a Redis
/// URL): an operator's view of it. Opening never creates or migrates anything: an
/// operator's tool must not make a table a service would then find.
pub(crate) async fn open(url: &str, fast: Option<&str>) -> Result<Box<dyn Admin>, Failure> {
    let durable = durable(url).await?;
    let Some(fast) = fast else {
        return Ok(Box::new(durable));
    };
    tiered(durable, fast).await
}

/// `durable` behind the shared fast tier of `fast`, a Redis URL.
#[cfg(feature = "redis")]
async fn tiered(durable: Box<dyn Operated>, fast: &str) -> Result<Box<dyn Admin>, Failure> {
    let scheme = fast.split(':').next().unwrap_or("");
    if !matches!(
        scheme,
        "redis" | "rediss" | "redis+cluster" | "redis+sentinel"
    ) {
        return Err(failure(format!(
            "a shared fast tier is a Redis URL (redis://…), not {:?}",
            redacted(fast)
        )));
    }
    let (url, prefix) = split_param(fast, "prefix");
    let store = redis(&url, scheme).await?;
    let fast = match &prefix {
        Some(prefix) => store.with_prefix(prefix)?,
        None => store,
    };
    Ok(Box::new(TieredStore::new(fast, durable)))
}

#[cfg(not(feature = "redis"))]
async fn tiered(_: Box<dyn Operated>, _: &str) -> Result<Box<dyn Admin>, Failure> {
    Err(missing("redis", "a shared fast tier (--fast redis://…)"))
}

/// What a URL of a store this `idem` was built without is told.
#[allow(dead_code)] // with every feature on, every store is there
fn missing(feature: &str, what: &str) -> Failure {
    failure(format!(
        "this idem was built without {what}: cargo install idem-cli --features {feature}"
    ))
}

/// The password in `url`'s user information (`scheme://user:password@host`), if any, as
/// written and percent-decoded: what no message of `idem` may show.
pub(crate) fn passwords(url: &str) -> Vec<String> {
    let Some(password) = password(url) else {
        return Vec::new();
    };
    let decoded = percent_decoded(&password);
    let mut both = vec![password];
    both.extend(decoded.filter(|decoded| decoded != &both[0]));
    both
}

/// The password in `url`'s user information, as written.
fn password(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let userinfo = rest.split(['/', '?', '#']).next()?.rsplit_once('@')?.0;
    let password = userinfo.split_once(':')?.1;
    (!password.is_empty()).then(|| password.to_string())
}

/// `text` with its `%XX` escapes decoded, if they are UTF-8.
fn percent_decoded(text: &str) -> Option<String> {
    let decoded = percent_encoding::percent_decode_str(text)
        .decode_utf8()
        .ok()?;
    Some(decoded.into_owned())
}

/// What `idem` operates: a store that is also the operator's view of it.
pub(crate) trait Operated: Admin + idem_runtime::Store {}

impl<T: Admin + idem_runtime::Store> Operated for T {}

/// `url` with its password, if any, written `***`.
pub(crate) fn redacted(url: &str) -> String {
    match password(url) {
        Some(password) => url.replacen(&format!(":{password}@"), ":***@", 1),
        None => url.to_string(),
    }
}

/// The durable store of `url`.
async fn durable(url: &str) -> Result<Box<dyn Operated>, Failure> {
    let (url, table) = split_param(url, "table");
    let scheme = url.split(':').next().unwrap_or("");
    match scheme {
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => {
            let store = PostgresStore::connect(&url).await?;
            Ok(Box::new(match &table {
                Some(table) => store.with_table(table)?,
                None => store,
            }))
        }
        #[cfg(not(feature = "postgres"))]
        "postgres" | "postgresql" => Err(missing("postgres", "PostgreSQL")),
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => {
            let url = url.replacen("mariadb:", "mysql:", 1);
            let store = MySqlStore::connect(&url).await?;
            Ok(Box::new(match &table {
                Some(table) => store.with_table(table)?,
                None => store,
            }))
        }
        #[cfg(not(feature = "mysql"))]
        "mysql" | "mariadb" => Err(missing("mysql", "MySQL and MariaDB")),
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            let path = url
                .trim_start_matches("sqlite:")
                .trim_start_matches("//");
            if !std::path::Path::new(path).exists() {
                return Err(failure(format!("there is no SQLite file at {path:?}")));
            }
            let store = SqliteStore::open(path).await?;
            Ok(Box::new(match &table {
                Some(table) => store.with_table(table)?,
                None => store,
            }))
        }
        #[cfg(not(feature = "sqlite"))]
        "sqlite" => Err(missing("sqlite", "SQLite")),
        #[cfg(feature = "redis")]
        "redis" | "rediss" | "redis+cluster" | "redis+sentinel" => {
            if table.is_some() {
                return Err(failure(
                    "a Redis store has keys, not a table: name its prefix with ?prefix=NAME",
                ));
            }
            let (url, prefix) = split_param(&url, "prefix");
            let store = redis(&url, scheme).await?;
            Ok(Box::new(match &prefix {
                Some(prefix) => store.with_prefix(prefix)?,
                None => store,
            }))
        }
        #[cfg(not(feature = "redis"))]
        "redis" | "rediss" | "redis+cluster" | "redis+sentinel" => Err(missing("redis", "Redis")),
        #[cfg(feature = "dynamodb")]
        "dynamodb" => Ok(Box::new(dynamodb(&url, table)?)),
        #[cfg(not(feature = "dynamodb"))]
        "dynamodb" => Err(missing("dynamodb", "DynamoDB")),
        _ => Err(failure(format!(
            "unknown store URL {:?}: use postgres://…, mysql://…, sqlite:PATH, redis://…, redis+cluster://HOST:PORT,…, redis+sentinel://HOST:PORT,…/MASTER or dynamodb:",
            redacted(&url)
        ))),
    }
}

/// A Redis store: one server (`redis://`, `rediss://`), a cluster through any of its nodes
/// (`redis+cluster://host:port,host:port`), or the primary the sentinels name
/// (`redis+sentinel://host:port,host:port/master`).
#[cfg(feature = "redis")]
async fn redis(url: &str, scheme: &str) -> Result<RedisStore, Failure> {
    let rest = url.split_once("://").map_or("", |(_, rest)| rest);
    let nodes = |hosts: &str| -> Vec<String> {
        hosts
            .split(',')
            .filter(|host| !host.is_empty())
            .map(|host| format!("redis://{host}"))
            .collect()
    };
    Ok(match scheme {
        "redis+cluster" => {
            let nodes = nodes(rest.trim_end_matches('/'));
            RedisStore::connect_cluster(nodes.iter().map(String::as_str)).await?
        }
        "redis+sentinel" => {
            let Some((hosts, master)) = rest.split_once('/').filter(|(_, m)| !m.is_empty()) else {
                return Err(failure(
                    "a sentinel URL names its master: redis+sentinel://HOST:PORT,…/MASTER",
                ));
            };
            let nodes = nodes(hosts);
            RedisStore::connect_sentinel(nodes.iter().map(String::as_str), master).await?
        }
        _ => RedisStore::connect(url).await?,
    })
}

/// The table a DynamoDB URL names none: the SQL stores' default name.
#[cfg(feature = "dynamodb")]
const DYNAMODB_TABLE: &str = "idem_records";

/// A DynamoDB store: `dynamodb:` (or `dynamodb://`) with `?table=` (default
/// `idem_records`), `?region=` (default `AWS_REGION`, then `AWS_DEFAULT_REGION`) and
/// `?endpoint=` (an emulator's, or a VPC endpoint's; default AWS's for the region). The
/// credentials are the environment's: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and
/// `AWS_SESSION_TOKEN`. HTTPS with rustls and the system's roots.
#[cfg(feature = "dynamodb")]
fn dynamodb(url: &str, table: Option<String>) -> Result<DynamoDbStore, Failure> {
    use aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};

    let (url, region) = split_param(url, "region");
    let (url, endpoint) = split_param(&url, "endpoint");
    let rest = url.trim_start_matches("dynamodb:").trim_start_matches("//");
    if !rest.is_empty() {
        return Err(failure(format!(
            "a DynamoDB URL names its table, region and endpoint as parameters (dynamodb:?table=NAME&region=REGION&endpoint=URL), not {rest:?}"
        )));
    }
    let var = |name: &str| std::env::var(name).ok().filter(|value| !value.is_empty());
    let region = region
        .or_else(|| var("AWS_REGION"))
        .or_else(|| var("AWS_DEFAULT_REGION"))
        .ok_or_else(|| failure("DynamoDB needs a region: ?region=REGION, or AWS_REGION"))?;
    let (Some(id), Some(secret)) = (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) else {
        return Err(failure(
            "DynamoDB's credentials are taken from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN); \
             from a profile or SSO: eval \"$(aws configure export-credentials --format env)\"",
        ));
    };
    let credentials = Credentials::new(id, secret, var("AWS_SESSION_TOKEN"), None, "environment");
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    let mut config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(region))
        .credentials_provider(credentials)
        .http_client(http);
    if let Some(endpoint) = endpoint {
        config = config.endpoint_url(endpoint);
    }
    let client = aws_sdk_dynamodb::Client::from_conf(config.build());
    Ok(DynamoDbStore::new(
        client,
        table.as_deref().unwrap_or(DYNAMODB_TABLE),
    ))
}

/// The URL without its parameter `name`, and the value it gives.
fn split_param(url: &str, name: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_string(), None);
    };
    let mut table = None;
    let rest: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            match pair
                .strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('='))
            {
                Some(value) => {
                    table = Some(value.to_string());
                    false
                }
                None => !pair.is_empty(),
            }
        })
        .collect();
    let url = if rest.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    (url, table)
}

#[cfg(test)]
mod tests {
    use super::{password, redacted, split_param};

    #[test]
    fn a_password_is_found_and_hidden() {
        assert_eq!(
            password("postgres://app:s3cr%40t@db:5432/app?table=t").as_deref(),
            Some("s3cr%40t")
        );
        assert_eq!(
            super::passwords("postgres://app:s3cr%40t@db/app"),
            ["s3cr%40t", "s3cr@t"]
        );
        assert_eq!(
            password("redis://:hunter2@cache:6379/0").as_deref(),
            Some("hunter2")
        );
        assert_eq!(password("postgres://app@db/app"), None);
        assert_eq!(password("sqlite:/var/idem.db"), None);
        assert_eq!(redacted("mysql://root:pw@h/db"), "mysql://root:***@h/db");
    }

    fn split_table(url: &str) -> (String, Option<String>) {
        split_param(url, "table")
    }

    #[test]
    fn the_table_is_taken_out_of_the_url() {
        assert_eq!(
            split_param("redis://h:6379/0?prefix=billing:idem:", "prefix"),
            ("redis://h:6379/0".into(), Some("billing:idem:".into()))
        );
        assert_eq!(
            split_table("postgres://u@h/db?tablespace=x"),
            ("postgres://u@h/db?tablespace=x".into(), None),
            "only the parameter itself"
        );
        assert_eq!(
            split_table("postgres://u@h/db?table=my_idem"),
            ("postgres://u@h/db".into(), Some("my_idem".into()))
        );
        assert_eq!(
            split_table("postgres://u@h/db?sslmode=require&table=t&application_name=x"),
            (
                "postgres://u@h/db?sslmode=require&application_name=x".into(),
                Some("t".into())
            )
        );
        assert_eq!(split_table("sqlite:a.db"), ("sqlite:a.db".into(), None));
    }
}
