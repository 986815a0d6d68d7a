//! The table's making and its checks: [`migrate`](super::MySqlStore::migrate) (with the
//! once-only upgrade of an earlier version's token column), and the checks made once per
//! store before its first claim (the server keeps an `AUTO_INCREMENT`, the table's tokens
//! come from its own, the pool's sessions commit and read what committed).

use std::time::Duration;

use sqlx::Row;

use super::statements::{at_least, Bounded, Server, TEXT};
use super::MySqlDriver;
use crate::store::sql::{self, Driver};
use crate::Error;

impl MySqlDriver {
    /// Creates the table if it is absent, or upgrades an earlier version's (see
    /// [`MySqlStore::migrate`](super::MySqlStore::migrate)).
    pub(super) async fn migrate_table(&self, timeout: Duration) -> Result<(), Error> {
        let (version, lock_mode): (String, i64) = sql::within(
            Self::NAME,
            timeout,
            sqlx::query_as("SELECT VERSION(), CAST(@@innodb_autoinc_lock_mode AS SIGNED)")
                .fetch_one(&self.pool),
        )
        .await?;
        refuse_forgetful(&version).map_err(Error::store)?;
        if lock_mode == 0 {
            tracing::warn!(
                table = %self.sql.table.name,
                "innodb_autoinc_lock_mode = 0 holds the AUTO_INCREMENT lock to the end of each insert: claims queue behind a claim that waits for a row lock; set it to 1 or 2"
            );
        }
        let mut conn = sql::within(Self::NAME, timeout, self.pool.acquire()).await?;
        let made = sql::within(Self::NAME, timeout, async {
            sqlx::query(&self.sql.create).execute(&mut *conn).await?;
            Ok(self.tokens_grow(&mut conn).await?
                && self.about_missing(&mut conn).await?.is_empty()
                && self.narrow_text(&mut conn).await?.is_empty())
        })
        .await?;
        if made {
            return Ok(());
        }
        // Serialised across processes (a named lock), and looked at again under it.
        let lock = format!("'idem_migrate_{}'", self.sql.table.name);
        let upgraded = async {
            let locked: Option<i64> = sqlx::query_scalar(&format!("SELECT GET_LOCK({lock}, 60)"))
                .fetch_one(&mut *conn)
                .await?;
            if locked != Some(1) {
                return Err(sqlx::Error::Protocol(
                    "another process held the migration's lock for a minute".into(),
                ));
            }
            let upgraded = match self.upgrade(&mut conn).await {
                Ok(()) => match self.add_about(&mut conn).await {
                    Ok(()) => self.widen_text(&mut conn).await,
                    failed => failed,
                },
                failed => failed,
            };
            sqlx::query(&format!("SELECT RELEASE_LOCK({lock})"))
                .execute(&mut *conn)
                .await?;
            upgraded
        };
        upgraded.await.map_err(Error::store)
    }

    /// Checks, once, that the server keeps an `AUTO_INCREMENT` across restarts, that the
    /// table's tokens come from its own (on a table of an earlier version, whose tokens came
    /// from a table of their own, an insert would give every claim the token 0, so its
    /// claims are refused until [`migrate`](super::MySqlStore::migrate) has upgraded it), and that the
    /// pool's sessions are fit for the store's statements.
    pub(super) async fn checked(&self, timeout: Duration) -> Result<Server, Error> {
        let server = match self.sql.server.get() {
            Some(server) => *server,
            None => {
                let mut conn = sql::within(Self::NAME, timeout, self.pool.acquire()).await?;
                self.server(timeout, &mut conn).await?
            }
        };
        self.sql
            .sessions
            .get_or_try_init(|| async {
                let session = format!(
                    "SELECT CAST({} AS CHAR), CAST(@@SESSION.autocommit AS SIGNED)",
                    server.isolation()
                );
                let (isolation, autocommit): (String, i64) = sql::within(
                    Self::NAME,
                    timeout,
                    sqlx::query_as(&session).fetch_one(&self.pool),
                )
                .await?;
                refuse_session(&isolation, autocommit)
            })
            .await?;
        Ok(server)
    }

    /// The server, and its table checked (see `checked`), once, on `on`:
    /// the pool, or the caller's own connection for a claim in its transaction. One that
    /// waited for another connection of the pool while it held one could wait for itself
    /// (callers holding every connection in transactions).
    pub(super) async fn server(
        &self,
        timeout: Duration,
        on: &mut sqlx::MySqlConnection,
    ) -> Result<Server, Error> {
        self.sql
            .server
            .get_or_try_init(|| async {
                // The text protocol, as every statement a claim sends on a caller's connection.
                let row = sql::within(Self::NAME, timeout, sqlx::Executor::fetch_one(on, sqlx::raw_sql(&self.sql.check)))
                    .await?;
                let version: String = row.try_get(0).map_err(Error::store)?;
                let token: Option<String> = row.try_get(1).map_err(Error::store)?;
                refuse_forgetful(&version).map_err(Error::store)?;
                let table = &self.sql.table.name;
                match token {
                    Some(extra) if is_auto_increment(&extra) => {}
                    Some(_) => return Err(Error::store(format!(
                        "the table {table:?} was made by an earlier version, whose fencing tokens came from a table of their own: run MySqlStore::migrate() to upgrade it"
                    ))),
                    None => return Err(Error::store(format!(
                        "the table {table:?} does not exist: run MySqlStore::migrate()"
                    ))),
                }
                Ok(Server::of(&version))
            })
            .await
            .copied()
    }

    /// The statements that wait for row locks, bounded for this server and timeout.
    pub(super) async fn bounded(&self, timeout: Duration) -> Result<&Bounded, Error> {
        let server = self.checked(timeout).await?;
        Ok(self
            .bounded
            .get_or_init(|| async { Bounded::of(&self.sql, server, timeout) })
            .await)
    }

    /// Whether the table's `token` column is the `AUTO_INCREMENT` tokens come from.
    pub(super) async fn tokens_grow(
        &self,
        conn: &mut sqlx::MySqlConnection,
    ) -> Result<bool, sqlx::Error> {
        let (_, extra): (String, Option<String>) = sqlx::query_as(&self.sql.check)
            .fetch_one(&mut *conn)
            .await?;
        Ok(extra.is_some_and(|extra| is_auto_increment(&extra)))
    }

    /// The columns that say whose a record is ([`ABOUT`]) that the table lacks: a table of
    /// an earlier version lacks them all.
    async fn about_missing(
        &self,
        conn: &mut sqlx::MySqlConnection,
    ) -> Result<Vec<(&'static str, &'static str)>, sqlx::Error> {
        let present: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(COLUMN_NAME AS CHAR) FROM information_schema.COLUMNS \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
        )
        .bind(&self.sql.table.name)
        .fetch_all(&mut *conn)
        .await?;
        Ok(ABOUT
            .into_iter()
            .filter(|(name, _)| !present.iter().any(|p| p.eq_ignore_ascii_case(name)))
            .collect())
    }

    /// The text columns of [`ABOUT`] that are not UTF-8 (`utf8mb4`), or whose collation is
    /// binary (which the driver reads back as a `BLOB`): those of a table made by an earlier
    /// version in a database whose default is `latin1` or `utf8mb3`.
    async fn narrow_text(
        &self,
        conn: &mut sqlx::MySqlConnection,
    ) -> Result<Vec<String>, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT CAST(COLUMN_NAME AS CHAR) FROM information_schema.COLUMNS \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? \
             AND COLUMN_NAME IN ('namespace', 'label', 'holder') \
             AND (CHARACTER_SET_NAME <> 'utf8mb4' OR COLLATION_NAME LIKE '%\\_bin')",
        )
        .bind(&self.sql.table.name)
        .fetch_all(&mut *conn)
        .await
    }

    /// Makes the text columns of [`ABOUT`] UTF-8, in place, converting what they hold.
    async fn widen_text(&self, conn: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
        let narrow = self.narrow_text(conn).await?;
        if narrow.is_empty() {
            return Ok(());
        }
        let columns = narrow
            .iter()
            // Names from the fixed list above, read back from the server.
            .filter(|name| ["namespace", "label", "holder"].contains(&name.as_str()))
            .map(|name| format!("MODIFY {name} {TEXT}"));
        self.alter(conn, columns).await
    }

    /// Alters the table by `changes` (`ADD COLUMN …`, `MODIFY …`), in one statement.
    async fn alter(
        &self,
        conn: &mut sqlx::MySqlConnection,
        changes: impl Iterator<Item = String>,
    ) -> Result<(), sqlx::Error> {
        let changes: Vec<String> = changes.collect();
        let alter = format!(
            "ALTER TABLE `{}` {}",
            self.sql.table.name,
            changes.join(", ")
        );
        sqlx::Executor::execute(&mut *conn, sqlx::raw_sql(&alter)).await?;
        Ok(())
    }

    /// Adds the columns of [`ABOUT`] the table lacks, in place: nullable, so rows written
    /// before list as "namespace unknown".
    async fn add_about(&self, conn: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
        let missing = self.about_missing(conn).await?;
        if missing.is_empty() {
            return Ok(());
        }
        let columns = missing
            .iter()
            .map(|(name, kind)| format!("ADD COLUMN {name} {kind}"));
        self.alter(conn, columns).await
    }

    /// Makes an earlier version's `token` column the `AUTO_INCREMENT`, starting above the
    /// table's tokens and above what its token tables drew (they are left as they are).
    pub(super) async fn upgrade(
        &self,
        conn: &mut sqlx::MySqlConnection,
    ) -> Result<(), sqlx::Error> {
        if self.tokens_grow(conn).await? {
            return Ok(()); // another process upgraded it first
        }
        let mut floor: i64 = sqlx::query_scalar(&self.sql.upgrade_floor)
            .fetch_one(&mut *conn)
            .await?;
        let legacy: Vec<(String, String)> = sqlx::query_as(&self.sql.legacy)
            .fetch_all(&mut *conn)
            .await?;
        for (table, column) in legacy {
            // Names from `Statements::legacy`: this table's name and a suffix, both checked.
            let drawn: i64 = sqlx::query_scalar(&format!(
                "SELECT CAST(COALESCE(MAX(`{column}`), 0) AS SIGNED) FROM `{table}`"
            ))
            .fetch_one(&mut *conn)
            .await?;
            floor = floor.max(drawn);
        }
        let upgrade = format!("{}{}", self.sql.upgrade, floor + 1);
        sqlx::Executor::execute(&mut *conn, sqlx::raw_sql(&upgrade)).await?;
        Ok(())
    }
}

/// The columns that say whose a record is, added in place to a table of an earlier
/// version: the claim's namespace, label, holder and lease, whether a row is a step's
/// record, how long a claim that lapsed unsettled is kept (its call's TTL), and whether a
/// claim took one over.
const ABOUT: [(&str, &str); 7] = [
    ("namespace", TEXT),
    ("label", TEXT),
    ("holder", TEXT),
    ("lease_ms", "BIGINT NULL"),
    ("step", "BOOLEAN NULL"),
    ("ttl_ms", "BIGINT NULL"),
    ("taken_over", "BOOLEAN NULL"),
];

/// Whether a column's `EXTRA` in `information_schema` says it is an `AUTO_INCREMENT`.
fn is_auto_increment(extra: &str) -> bool {
    extra.to_ascii_lowercase().contains("auto_increment")
}

/// Refuses a server of `version` that forgets an `AUTO_INCREMENT` on restart.
fn refuse_forgetful(version: &str) -> Result<(), sqlx::Error> {
    if keeps_auto_increment(version) {
        return Ok(());
    }
    Err(sqlx::Error::Configuration(
        format!("MySQL {version} forgets an AUTO_INCREMENT on restart, so fencing tokens could go back: use MySQL 8.0 or MariaDB 10.2.4 or later").into(),
    ))
}

/// Refuses a pool whose sessions the store's statements cannot rely on: at `READ
/// UNCOMMITTED` a read sees a result whose transaction may still roll back, and would
/// replay it; without `autocommit` a claim and its record are never committed.
fn refuse_session(isolation: &str, autocommit: i64) -> Result<(), Error> {
    if isolation.eq_ignore_ascii_case("READ-UNCOMMITTED") {
        return Err(Error::config(
            "the pool's sessions run at READ UNCOMMITTED: the store would replay results whose transaction has not committed; connect the store's pool at READ COMMITTED or above (MySqlStore::connect does)",
        ));
    }
    if autocommit == 0 {
        return Err(Error::config(
            "the pool's sessions run with autocommit = 0: the store's claims and records would never commit; give the store a pool in autocommit (MySqlStore::connect does)",
        ));
    }
    Ok(())
}

/// Whether a server of `version` (`SELECT VERSION()`: `8.0.36`, `10.11.6-MariaDB-0+deb12u1`)
/// keeps a table's `AUTO_INCREMENT` across restarts: MySQL from 8.0, MariaDB from 10.2.4.
fn keeps_auto_increment(version: &str) -> bool {
    at_least(version, [10, 2, 4], [8, 0, 0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_that_forget_auto_increment_on_restart_are_known() {
        for kept in [
            "8.0.36",
            "8.4.0",
            "9.1.0-commercial",
            "10.2.4-MariaDB",
            "10.11.6-MariaDB-0+deb12u1",
            "11.4.2-MariaDB-ubu2404",
            "5.5.5-10.11.6-MariaDB",
        ] {
            assert!(keeps_auto_increment(kept), "{kept}");
        }
        for forgotten in [
            "5.7.44",
            "5.7.44-log",
            "10.2.3-MariaDB",
            "10.1.48-MariaDB",
            "5.5.5-10.1.2-MariaDB",
        ] {
            assert!(!keeps_auto_increment(forgotten), "{forgotten}");
        }
    }
}
