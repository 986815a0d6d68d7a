//! A store, by its URL.

use idem_runtime::admin::Admin;
use idem_runtime::{MySqlStore, PostgresStore, SqliteStore};

use crate::{failure, Failure};

/// The store of `url`, as an operator's view of it. Opening never creates or migrates
/// anything: an operator's tool must not make a table a service would then find.
pub(crate) async fn open(url: &str) -> Result<Box<dyn Admin>, Failure> {
    let (url, table) = split_table(url);
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
        "redis" | "rediss" | "dynamodb" => Err(failure(format!(
            "{scheme} stores cannot be operated from the command line yet: use idem_runtime::admin from a program on PostgreSQL, MySQL, SQLite or the memory store"
        ))),
        _ => Err(failure(format!(
            "unknown store URL {url:?}: use postgres://…, mysql://… or sqlite:PATH"
        ))),
    }
}

/// The URL without its `table` parameter, and the table it names.
fn split_table(url: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_string(), None);
    };
    let mut table = None;
    let rest: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.strip_prefix("table=") {
            Some(name) => {
                table = Some(name.to_string());
                false
            }
            None => !pair.is_empty(),
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
    use super::split_table;

    #[test]
    fn the_table_is_taken_out_of_the_url() {
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
