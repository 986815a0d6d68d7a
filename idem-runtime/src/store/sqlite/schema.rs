//! The file's making and its check: [`migrate`](super::SqliteStore::migrate) (WAL, the
//! table, its token counter and the counter's triggers), and the check made once per
//! store before its first claim (the triggers exist).

use sqlx::{Connection, Sqlite};
use tokio::time::Instant;

use super::statements::{Statements, ABOUT};
use super::writer;

/// Switches the file to WAL and creates what is absent, in one `BEGIN IMMEDIATE`
/// transaction, waiting for the file's lock until `deadline`.
pub(super) async fn migrate(
    pool: &sqlx::SqlitePool,
    sql: &Statements,
    deadline: Instant,
) -> Result<(), sqlx::Error> {
    let mut conn = writer(pool, deadline).await?;
    sqlx::query("PRAGMA journal_mode = WAL")
        .execute(&mut *conn)
        .await?;
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
    for statement in &sql.create {
        sqlx::query(statement).execute(&mut *tx).await?;
    }
    // A table of an earlier version: the columns an operator is shown, added in place.
    let present: Vec<String> = sqlx::query_scalar(&sql.about).fetch_all(&mut *tx).await?;
    for (name, kind) in ABOUT {
        if !present.iter().any(|p| p.eq_ignore_ascii_case(name)) {
            sqlx::query(&format!("{}{name} {kind}", sql.add_about))
                .execute(&mut *tx)
                .await?;
        }
    }
    tx.commit().await
}

impl Statements {
    /// Checks, once, that the table's token triggers exist: a table made by a version
    /// without them would give every take the same token, so its claims are refused until
    /// [`migrate`](super::SqliteStore::migrate) has run. `on` is the pool, or the caller's own
    /// connection for a claim in its transaction: one that waited for another connection of
    /// the pool while it held one could wait for itself (callers holding every connection
    /// in transactions, each waiting for the write lock it holds).
    pub(super) async fn checked<'c>(
        &self,
        on: impl sqlx::Executor<'c, Database = Sqlite>,
    ) -> Result<(), sqlx::Error> {
        self.checked
            .get_or_try_init(|| async {
                let found: i64 = sqlx::query_scalar(&self.triggers).fetch_one(on).await?;
                if found == 2 {
                    Ok(())
                } else {
                    Err(sqlx::Error::Configuration(
                        format!(
                            "the table {:?} lacks the triggers that make its fencing tokens grow: run SqliteStore::migrate()",
                            self.table.name
                        )
                        .into(),
                    ))
                }
            })
            .await
            .map(|_| ())
    }
}
