//! A store, by its URL.

use idem_runtime::admin::Admin;
use idem_runtime::{MySqlStore, PostgresStore, RedisStore, SqliteStore};

use crate::{failure, Failure};

/// The store of `url`, as an operator's view of it. Opening never creates or migrates
/// anything: an operator's tool must not make a table a service would then find.
pub(crate) async fn open(url: &str) -> Result<Box<dyn Admin>, Failure> {
    let (url, table) = split_param(url, "table");
    let scheme = url.split(':').next().unwrap_or("");
    match scheme {
        "postgres" | "postgresql" => {
            let store = PostgresStore::connect(&url).await?;
            Ok(Box::new(match &table {
                Some(table) => store.with_table(table)?,
                None => store,
            }))
        }
        "mysql" | "mariadb" => {
            let url = url.replacen("mariadb:", "mysql:", 1);
            let store = MySqlStore::connect(&url).await?;
            Ok(Box::new(match &table {
                Some(table) => store.with_table(table)?,
                None => store,
            }))
        }
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
        "redis" | "rediss" | "redis+cluster" | "redis+sentinel" => {
            let (url, prefix) = split_param(&url, "prefix");
            let store = redis(&url, scheme).await?;
            Ok(Box::new(match &prefix {
                Some(prefix) => store.with_prefix(prefix)?,
                None => store,
            }))
        }
        "dynamodb" => Err(failure(
            "DynamoDB stores cannot be operated from the command line yet: use idem_runtime::admin from a program on the other stores",
        )),
        _ => Err(failure(format!(
            "unknown store URL {url:?}: use postgres://…, mysql://…, sqlite:PATH, redis://…, redis+cluster://HOST:PORT,… or redis+sentinel://HOST:PORT,…/MASTER"
        ))),
    }
}

/// A Redis store: one server (`redis://`, `rediss://`), a cluster through any of its nodes
/// (`redis+cluster://host:port,host:port`), or the primary the sentinels name
/// (`redis+sentinel://host:port,host:port/master`).
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
    use super::split_param;

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
