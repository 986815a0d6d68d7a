//! The statements of one table, in MySQL's dialect, written once per store: the prepared
//! ones, and the messages of several statements with the runtime's own literals written in.

use std::time::Duration;

use super::PURGE_BATCH;
use crate::store::sql::{is_identifier, millis, Table};
use crate::{Error, Fingerprint, Key, Token};

/// The server's clock in Unix milliseconds, independent of the session's time zone.
/// The type of the columns that say whose a record is (its namespace, label and holder):
/// UTF-8 whatever the table's or the database's default, so that a namespace reads back as
/// it was written and a prefix finds it (a `latin1` or `utf8mb3` table would mangle what it
/// cannot hold). The prefix is compared as bytes; the collation is the server's default
/// for `utf8mb4` (a binary one would read back as a `BLOB`).
pub(super) const TEXT: &str = "TEXT CHARACTER SET utf8mb4 NULL";

const NOW: &str = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";

/// What the store learned of its server, once: which dialect bounds a statement's waits,
/// and the name of the isolation level's variable.
#[derive(Clone, Copy, Debug)]
pub(super) struct Server {
    pub(super) mariadb: bool,
    /// Whether a locking read can skip the rows another transaction holds (`SKIP LOCKED`:
    /// MariaDB from 10.6, MySQL from 8.0.1).
    pub(super) skips_locked: bool,
}

impl Server {
    /// The server of `version` (`SELECT VERSION()`).
    pub(super) fn of(version: &str) -> Self {
        Self {
            mariadb: version.contains("MariaDB"),
            skips_locked: at_least(version, [10, 6, 0], [8, 0, 1]),
        }
    }

    /// The session variable of the isolation level: MariaDB before 11.1 and MySQL before 8.0
    /// name it `tx_isolation`, MySQL 8 only `transaction_isolation`.
    pub(super) fn isolation(self) -> &'static str {
        if self.mariadb {
            "@@SESSION.tx_isolation"
        } else {
            "@@SESSION.transaction_isolation"
        }
    }

    /// `statement`, waiting on the server no longer than `within` (a little less than the
    /// store's timeout, so the server gives up before the caller does and an abandoned
    /// statement never lands later) and for a row lock no longer than `lock_wait` seconds.
    /// MariaDB: `SET STATEMENT max_statement_time` (fractional seconds) and
    /// `innodb_lock_wait_timeout` (0: no wait). MySQL: the `SET_VAR` hint of the lock
    /// wait, whose least is a second: with a store timeout under about a second, a
    /// statement can outwait its caller there.
    pub(super) fn bound(self, within: Duration, lock_wait: u64, statement: &str) -> String {
        let seconds = within.as_secs_f64();
        if self.mariadb {
            format!(
                "SET STATEMENT max_statement_time = {seconds:.3}, innodb_lock_wait_timeout = {lock_wait} FOR {statement}"
            )
        } else {
            let lock_wait = lock_wait.max(1);
            let (verb, rest) = statement.split_once(' ').unwrap_or((statement, ""));
            format!("{verb} /*+ SET_VAR(innodb_lock_wait_timeout = {lock_wait}) */ {rest}")
        }
    }
}

/// Whether a server of `version` is at least `mariadb` (a MariaDB) or `mysql` (a MySQL).
pub(super) fn at_least(version: &str, mariadb: [u32; 3], mysql: [u32; 3]) -> bool {
    let maria = version.contains("MariaDB");
    // MariaDB's handshake (and some proxies) prefix its version with `5.5.5-`.
    let version = match version.strip_prefix("5.5.5-") {
        Some(rest) if maria => rest,
        _ => version,
    };
    let numbers: Vec<u32> = version
        .split(|c: char| !c.is_ascii_digit())
        .take(3)
        .map(|n| n.parse().unwrap_or(0))
        .collect();
    let least = if maria { mariadb } else { mysql };
    numbers.as_slice() >= &least[..]
}

/// The statements that may wait for a row lock, bounded for one server and timeout (see
/// [`Server::bound`]); made once per store, at its first operation.
pub(super) struct Bounded {
    pub(super) insert: String,
    pub(super) lock: String,
    pub(super) take: String,
    pub(super) complete: String,
    pub(super) release: String,
    pub(super) renew: String,
    pub(super) record_step: String,
    pub(super) remove_lock: String,
    pub(super) remove_steps: String,
    pub(super) remove: String,
    /// The purge's locking read of expired rows by key, skipping rows an open transaction
    /// holds; the keys follow.
    pub(super) lock_expired: String,
}

impl Bounded {
    /// `sql`'s statements, each ending on the server within 9/10 of `timeout`.
    pub(super) fn of(sql: &Statements, server: Server, timeout: Duration) -> Self {
        let within = timeout * 9 / 10;
        // A row lock held past a second belongs to an open transaction (a claim in a
        // caller's transaction): a claim is told the key is in progress instead of holding
        // a pooled connection in the queue. Ordinary claims and steps hold a row's lock for
        // a statement or two. (MariaDB's 0 would not wait at all, and a duplicate racing
        // the first claim of a key would be refused instead of waiting its milliseconds.)
        let bound = |statement: &str| server.bound(within, 1, statement);
        Self {
            insert: bound(&sql.insert),
            lock: bound(&sql.lock),
            take: bound(&sql.take),
            complete: bound(&sql.complete),
            release: bound(&sql.release),
            renew: bound(&sql.renew),
            record_step: bound(&sql.record_step),
            remove_lock: bound(&sql.remove_lock),
            remove_steps: bound(&sql.remove_steps),
            remove: bound(&sql.remove),
            lock_expired: bound(&sql.lock_expired),
        }
    }
}

/// The statements of one table, written once.
pub(super) struct Statements {
    /// The server's version, and the `token` column's `EXTRA` (`auto_increment` once
    /// migrated; see `MySqlStore::checked`).
    pub(super) check: String,
    /// The server, once `check` found it and a table that makes tokens grow (see
    /// `MySqlStore::server`); once per store.
    pub(super) server: tokio::sync::OnceCell<Server>,
    /// Set once the pool's sessions were found fit for the store (see
    /// `MySqlStore::checked`).
    pub(super) sessions: tokio::sync::OnceCell<()>,
    pub(super) create: String,
    /// Makes an earlier version's `token` column an `AUTO_INCREMENT`, less its start.
    pub(super) upgrade: String,
    /// The largest token an earlier version's table and token tables hold, if any (see
    /// `upgrade`).
    pub(super) upgrade_floor: String,
    /// The token tables of earlier versions (a counter `<table>_token (last)`, then an
    /// `AUTO_INCREMENT` `<table>_tokens (id)`), as (table, column) rows.
    pub(super) legacy: String,
    pub(super) live: String,
    pub(super) insert: String,
    pub(super) lock: String,
    pub(super) take: String,
    pub(super) complete: String,
    /// The completion of a claim in the caller's transaction, with its value bound: its own
    /// row, whatever the lease says (see [`complete_literal`](Self::complete_literal)).
    pub(super) complete_in: String,
    pub(super) release: String,
    pub(super) renew: String,
    pub(super) record_step: String,
    /// The table's name, and the reads the core runs itself: a result, a lease, a call's
    /// steps.
    pub(super) table: Table,
    pub(super) remove_lock: String,
    pub(super) remove_steps: String,
    pub(super) remove: String,
    /// A batch of expired rows' keys, and the start of the statement that deletes them.
    pub(super) expired: String,
    pub(super) delete_expired: String,
    /// The start of the purge's locking read of expired rows by key (see [`Bounded`]).
    pub(super) lock_expired: String,
}

impl Statements {
    /// `live` with the key written in, for a message of several statements (claims in a
    /// transaction, `transaction.rs`). Every literal is the runtime's own: bytes in hex,
    /// numbers in digits.
    pub(super) fn live_literal(&self, key: &Key) -> String {
        format!(
            "SELECT token, completed, fingerprint, value FROM `{}` \
             WHERE `key` = X'{}' AND expires_at > {NOW}",
            self.table.name,
            hex::encode(key.as_bytes())
        )
    }

    /// The key's row under a shared lock, with its key written in, for claims in the
    /// caller's transaction: its latest committed version, and whether it is live.
    pub(super) fn share_literal(&self, key: &Key) -> String {
        format!(
            "SELECT token, completed, fingerprint, value, expires_at > {NOW} FROM `{}` \
             WHERE `key` = X'{}' LOCK IN SHARE MODE",
            self.table.name,
            hex::encode(key.as_bytes())
        )
    }

    /// The first claim, in the caller's transaction, of a key that has no row: the row
    /// inserted unless one is there, with the next token (the insert's id). (No nonce: a
    /// claim in a transaction is never taken again by its own caller.)
    pub(super) fn insert_literal(
        &self,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> String {
        self.claim_literal("INSERT IGNORE", key, fingerprint, lease)
    }

    /// The takeover, in the caller's transaction, of the key's row, which that transaction
    /// has locked: the row replaced by one with the next token (the insert's id; taken after
    /// the lock, so above the row's).
    pub(super) fn take_literal(
        &self,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> String {
        self.claim_literal("REPLACE", key, fingerprint, lease)
    }

    /// A claim's row written by `verb`, with its values written in.
    fn claim_literal(
        &self,
        verb: &str,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> String {
        format!(
            "{verb} INTO `{}` (`key`, completed, fingerprint, value, expires_at, lease_ms) \
             VALUES (X'{}', FALSE, {}, NULL, {NOW} + {lease}, {lease})",
            self.table.name,
            hex::encode(key.as_bytes()),
            fingerprint_literal(fingerprint),
            lease = millis(lease)
        )
    }

    /// The completion of a claim in the caller's transaction: its own row, whatever the
    /// lease says, with its values written in.
    pub(super) fn complete_literal(
        &self,
        key: &Key,
        token: Token,
        record: &[u8],
        ttl: i64,
    ) -> String {
        format!(
            "UPDATE `{}` SET completed = TRUE, value = X'{}', expires_at = {NOW} + {ttl} \
             WHERE `key` = X'{}' AND token + 0 = {} AND NOT completed",
            self.table.name,
            hex::encode(record),
            hex::encode(key.as_bytes()),
            token.get()
        )
    }

    /// The statements of `table`, after checking the name.
    pub(super) fn new(table: &str) -> Result<Self, Error> {
        if is_identifier(table) {
            Ok(Self::of(table))
        } else {
            Err(Error::store(format!(
                "invalid table name {table:?}: use letters, digits and `_` (at most 50, not starting with a digit)"
            )))
        }
    }

    /// The statements of a checked table name.
    pub(super) fn of(name: &str) -> Self {
        let t = format!("`{name}`");
        let index = format!("`{name}_expires_at`");
        let token_index = format!("`{name}_token`");
        let live_row = format!("`key` = ? AND expires_at > {NOW}");
        Self {
            check: format!(
                "SELECT VERSION(), (SELECT EXTRA FROM information_schema.COLUMNS \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{name}' AND COLUMN_NAME = 'token')"
            ),
            server: tokio::sync::OnceCell::new(),
            sessions: tokio::sync::OnceCell::new(),
            // A token is the next value of the table's AUTO_INCREMENT, taken by the insert
            // (or the REPLACE of a takeover) that writes the row: no statement of its own.
            // The value only grows (InnoDB keeps it across restarts, and after the rows that
            // held the largest are deleted), and its lock is released as soon as it is
            // taken, so no claim waits for another's token and a claim in a caller's
            // transaction holds no lock other claims need for it.
            create: format!(
                "CREATE TABLE IF NOT EXISTS {t} (\
                    `key` VARBINARY(32) NOT NULL PRIMARY KEY, \
                    token BIGINT NOT NULL AUTO_INCREMENT, \
                    completed BOOLEAN NOT NULL, \
                    fingerprint VARBINARY(32) NULL, \
                    value LONGBLOB NULL, \
                    expires_at BIGINT NOT NULL, \
                    namespace {TEXT}, label {TEXT}, holder {TEXT}, \
                    lease_ms BIGINT NULL, step BOOLEAN NULL, ttl_ms BIGINT NULL, taken_over BOOLEAN NULL, \
                    INDEX {token_index} (token), \
                    INDEX {index} (expires_at)) ENGINE = InnoDB"
            ),
            upgrade: format!(
                "ALTER TABLE {t} MODIFY token BIGINT NOT NULL AUTO_INCREMENT, \
                 ADD INDEX {token_index} (token), AUTO_INCREMENT = "
            ),
            upgrade_floor: format!("SELECT CAST(COALESCE(MAX(token), 0) AS SIGNED) FROM {t}"),
            legacy: format!(
                "SELECT TABLE_NAME, COLUMN_NAME FROM information_schema.COLUMNS \
                 WHERE TABLE_SCHEMA = DATABASE() AND (\
                    (TABLE_NAME = '{name}_token' AND COLUMN_NAME = 'last') OR \
                    (TABLE_NAME = '{name}_tokens' AND COLUMN_NAME = 'id'))"
            ),
            live: format!("SELECT token, completed, fingerprint, value FROM {t} WHERE {live_row}"),
            insert: format!(
                "INSERT IGNORE INTO {t} (`key`, completed, fingerprint, value, expires_at, namespace, label, holder, lease_ms, ttl_ms, taken_over) \
                 VALUES (?, FALSE, ?, ?, {NOW} + ?, ?, ?, ?, ?, ?, ?)"
            ),
            lock: format!(
                "SELECT token, completed, fingerprint, value, expires_at > {NOW}, \
                    COALESCE(taken_over, FALSE) FROM {t} \
                 WHERE `key` = ? FOR UPDATE"
            ),
            // The row replaced by a new one, which takes the next token.
            take: format!(
                "REPLACE INTO {t} (`key`, completed, fingerprint, value, expires_at, namespace, label, holder, lease_ms, ttl_ms, taken_over) \
                 VALUES (?, FALSE, ?, ?, {NOW} + ?, ?, ?, ?, ?, ?, ?)"
            ),
            // `token + 0` in the statements that write a holder's row: kept off the token
            // index, which the optimizer would take for a range (with `key` filtered after),
            // and whose next-key lock past the holder's token, held to the end of a caller's
            // transaction at REPEATABLE READ, would hold every new claim's insert (new tokens
            // are larger) until then. The primary key finds the row by itself.
            complete: format!(
                "UPDATE {t} SET completed = TRUE, value = ?, expires_at = {NOW} + ? \
                 WHERE `key` = ? AND token + 0 = ? AND NOT completed AND expires_at > {NOW}"
            ),
            complete_in: format!(
                "UPDATE {t} SET completed = TRUE, value = ?, expires_at = {NOW} + ? \
                 WHERE `key` = ? AND token + 0 = ? AND NOT completed"
            ),
            release: format!(
                "DELETE FROM {t} WHERE `key` = ? AND token + 0 = ? AND NOT completed AND expires_at > {NOW}"
            ),
            renew: format!(
                "UPDATE {t} SET expires_at = {NOW} + ? \
                 WHERE `key` = ? AND token + 0 = ? AND NOT completed AND expires_at > {NOW}"
            ),
            // The call's row is read under a shared lock, so a takeover waits for the step's
            // record, or the record finds the new token; a step recorded again under the
            // same claim is replaced. The step's row keeps the call's token.
            record_step: format!(
                "REPLACE INTO {t} (`key`, token, completed, fingerprint, value, expires_at, step) \
                 SELECT ?, token, TRUE, NULL, ?, {NOW} + ?, TRUE FROM {t} \
                 WHERE `key` = ? AND token + 0 = ? AND NOT completed AND expires_at > {NOW} \
                 LOCK IN SHARE MODE"
            ),
            table: Table {
                name: name.to_string(),
                steps: format!(
                    "SELECT `key`, value FROM {t} \
                     WHERE `key` <> ? AND `key` BETWEEN ? AND ? AND completed AND expires_at > {NOW}"
                ),
                // Rounded down by a millisecond: `NOW` truncates, and a copy in a fast tier must
                // never outlive the row.
                lookup: format!(
                    "SELECT fingerprint, value, expires_at - {NOW} - 1 FROM {t} \
                     WHERE {live_row} AND completed"
                ),
                lease_left: format!(
                    "SELECT expires_at - {NOW} FROM {t} WHERE {live_row} AND NOT completed"
                ),
                holding: format!(
                    "SELECT CAST(expires_at - {NOW} AS SIGNED), holder FROM {t} \
                     WHERE {live_row} AND NOT completed"
                ),
                released: format!("SELECT token FROM {t} WHERE `key` = ? AND step IS TRUE"),
                #[cfg(feature = "admin")]
                admin: admin(&t),
            },
            remove_lock: format!("SELECT expires_at > {NOW} FROM {t} WHERE `key` = ? FOR UPDATE"),
            remove_steps: format!("DELETE FROM {t} WHERE `key` BETWEEN ? AND ? AND `key` <> ?"),
            remove: format!("DELETE FROM {t} WHERE `key` = ?"),
            // A purge reads what to delete without locking, then deletes it by primary key:
            // a locking range scan would wait for the first row past the range when an open
            // transaction holds it (a claim in a caller's transaction), and hold a gap that
            // new claims insert into meanwhile.
            // A claim that lapsed unsettled stays for its call's TTL, so that the claim
            // taking it over is told.
            expired: format!(
                "SELECT `key` FROM {t} WHERE expires_at <= {NOW} \
                 AND (completed OR expires_at + COALESCE(ttl_ms, 0) <= {NOW}) \
                 ORDER BY expires_at LIMIT {PURGE_BATCH}"
            ),
            // `expires_at + 0`: kept off the expiry index, which the optimizer would take for
            // a range scan (with the lock past the range), where the keys are point lookups.
            delete_expired: format!(
                "DELETE FROM {t} WHERE expires_at + 0 <= {NOW} \
                 AND (completed OR expires_at + COALESCE(ttl_ms, 0) <= {NOW}) AND `key` IN "
            ),
            // Point lookups on the primary key (no range, no gap past it), each row locked
            // unless an open transaction holds it, which is skipped: the delete that follows
            // in the same transaction then waits for nothing.
            lock_expired: format!(
                "SELECT `key` FROM {t} WHERE expires_at + 0 <= {NOW} \
                 AND (completed OR expires_at + COALESCE(ttl_ms, 0) <= {NOW}) AND `key` IN "
            ),
        }
    }
}

/// The statements of an operator ([`Admin`](crate::admin::Admin)) on the table `t`.
#[cfg(feature = "admin")]
fn admin(t: &str) -> crate::store::sql::AdminSql {
    crate::store::sql::AdminSql::new(&crate::store::sql::Spelling {
        told: None,
        table: t,
        key: "`key`",
        param: |_| "?".to_string(),
        live: &format!("expires_at > {NOW}"),
        now: NOW,
        left_ms: &format!("CAST(expires_at - {NOW} AS SIGNED)"),
        size: "CAST(LENGTH(value) AS SIGNED)",
        head: "SUBSTRING(value, 1, 1)",
        not_step: "step IS NOT TRUE",
        // Compared as bytes: the column's collation may ignore case.
        prefix: |len, prefix| {
            format!("CAST(SUBSTRING(COALESCE(namespace, ''), 1, {len}) AS BINARY) = CAST({prefix} AS BINARY)")
        },
        token_is: |token| format!("ABS(token) = {token}"),
        silent: &format!("(expires_at <= {NOW} OR (expires_at - {NOW}) * 2 < lease_ms)"),
        trace: &format!(
            "INSERT INTO {t} (`key`, token, completed, expires_at, step) \
             VALUES (?, ?, TRUE, {NOW} + 86400000, TRUE) \
             ON DUPLICATE KEY UPDATE token = VALUES(token), expires_at = VALUES(expires_at)"
        ),
    })
}

/// A fingerprint as an SQL literal: its bytes in hex, or `NULL`.
fn fingerprint_literal(fingerprint: Option<&Fingerprint>) -> String {
    fingerprint.map_or("NULL".to_string(), |f| {
        format!("X'{}'", hex::encode(f.as_bytes()))
    })
}
