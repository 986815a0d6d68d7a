//! The statements of one table, in MySQL's dialect, written once per store: the prepared
//! ones, and the messages of several statements with the runtime's own literals written in.

use std::time::Duration;

use super::PURGE_BATCH;
use crate::store::sql::{is_identifier, millis};
use crate::{Error, Fingerprint, Key, Token};

/// The server's clock in Unix milliseconds, independent of the session's time zone.
const NOW: &str = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";

/// The statements of one table, written once.
pub(super) struct Statements {
    pub(super) table: String,
    /// The server's version, and the `token` column's `EXTRA` (`auto_increment` once
    /// migrated; see `MySqlStore::checked`).
    pub(super) check: String,
    /// Whether `check` found a server and a table that make tokens grow, once per store (see
    /// `MySqlStore::checked`).
    pub(super) checked: tokio::sync::OnceCell<()>,
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
    /// The key's row under a shared lock, for claims in the caller's transaction.
    pub(super) share: String,
    pub(super) take: String,
    pub(super) complete: String,
    pub(super) release: String,
    pub(super) renew: String,
    pub(super) record_step: String,
    pub(super) steps: String,
    pub(super) remove_lock: String,
    pub(super) remove_steps: String,
    pub(super) remove: String,
    pub(super) lookup: String,
    pub(super) lease_left: String,
    /// A batch of expired rows' keys, and the start of the statement that deletes them.
    pub(super) expired: String,
    pub(super) delete_expired: String,
}

impl Statements {
    /// `live` with the key written in, for a message of several statements (claims in a
    /// transaction, `transaction.rs`). Every literal is the runtime's own: bytes in hex,
    /// numbers in digits.
    pub(super) fn live_literal(&self, key: &Key) -> String {
        format!(
            "SELECT token, completed, fingerprint, value FROM `{}` \
             WHERE `key` = X'{}' AND expires_at > {NOW}",
            self.table,
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
            "{verb} INTO `{}` (`key`, completed, fingerprint, value, expires_at) \
             VALUES (X'{}', FALSE, {}, NULL, {NOW} + {})",
            self.table,
            hex::encode(key.as_bytes()),
            fingerprint_literal(fingerprint),
            millis(lease)
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
             WHERE `key` = X'{}' AND token = {} AND NOT completed",
            self.table,
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
            table: name.to_string(),
            check: format!(
                "SELECT VERSION(), (SELECT EXTRA FROM information_schema.COLUMNS \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{name}' AND COLUMN_NAME = 'token')"
            ),
            checked: tokio::sync::OnceCell::new(),
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
                "INSERT IGNORE INTO {t} (`key`, completed, fingerprint, value, expires_at) \
                 VALUES (?, FALSE, ?, ?, {NOW} + ?)"
            ),
            lock: format!(
                "SELECT token, completed, fingerprint, value, expires_at > {NOW} FROM {t} \
                 WHERE `key` = ? FOR UPDATE"
            ),
            share: format!(
                "SELECT token, completed, fingerprint, value, expires_at > {NOW} FROM {t} \
                 WHERE `key` = ? LOCK IN SHARE MODE"
            ),
            // The row replaced by a new one, which takes the next token.
            take: format!(
                "REPLACE INTO {t} (`key`, completed, fingerprint, value, expires_at) \
                 VALUES (?, FALSE, ?, ?, {NOW} + ?)"
            ),
            complete: format!(
                "UPDATE {t} SET completed = TRUE, value = ?, expires_at = {NOW} + ? \
                 WHERE `key` = ? AND token = ? AND NOT completed AND expires_at > {NOW}"
            ),
            release: format!(
                "DELETE FROM {t} WHERE `key` = ? AND token = ? AND NOT completed AND expires_at > {NOW}"
            ),
            renew: format!(
                "UPDATE {t} SET expires_at = {NOW} + ? \
                 WHERE `key` = ? AND token = ? AND NOT completed AND expires_at > {NOW}"
            ),
            // The call's row is read under a shared lock, so a takeover waits for the step's
            // record, or the record finds the new token; a step recorded again under the
            // same claim is replaced. The step's row keeps the call's token.
            record_step: format!(
                "REPLACE INTO {t} (`key`, token, completed, fingerprint, value, expires_at) \
                 SELECT ?, token, TRUE, NULL, ?, {NOW} + ? FROM {t} \
                 WHERE `key` = ? AND token = ? AND NOT completed AND expires_at > {NOW} \
                 LOCK IN SHARE MODE"
            ),
            steps: format!(
                "SELECT `key`, value FROM {t} \
                 WHERE `key` <> ? AND `key` BETWEEN ? AND ? AND completed AND expires_at > {NOW}"
            ),
            remove_lock: format!("SELECT expires_at > {NOW} FROM {t} WHERE `key` = ? FOR UPDATE"),
            remove_steps: format!("DELETE FROM {t} WHERE `key` BETWEEN ? AND ? AND `key` <> ?"),
            remove: format!("DELETE FROM {t} WHERE `key` = ?"),
            // Rounded down by a millisecond: `NOW` truncates, and a copy in a fast tier must
            // never outlive the row.
            lookup: format!(
                "SELECT fingerprint, value, expires_at - {NOW} - 1 FROM {t} \
                 WHERE {live_row} AND completed"
            ),
            lease_left: format!(
                "SELECT expires_at - {NOW} FROM {t} WHERE {live_row} AND NOT completed"
            ),
            // A purge reads what to delete without locking, then deletes it by primary key:
            // a locking range scan would wait for the first row past the range when an open
            // transaction holds it (a claim in a caller's transaction), and hold a gap that
            // new claims insert into meanwhile.
            expired: format!(
                "SELECT `key` FROM {t} WHERE expires_at <= {NOW} ORDER BY expires_at LIMIT {PURGE_BATCH}"
            ),
            // `expires_at + 0`: kept off the expiry index, which the optimizer would take for
            // a range scan (with the lock past the range), where the keys are point lookups.
            delete_expired: format!(
                "DELETE FROM {t} WHERE expires_at + 0 <= {NOW} AND `key` IN "
            ),
        }
    }
}

/// A fingerprint as an SQL literal: its bytes in hex, or `NULL`.
fn fingerprint_literal(fingerprint: Option<&Fingerprint>) -> String {
    fingerprint.map_or("NULL".to_string(), |f| {
        format!("X'{}'", hex::encode(f.as_bytes()))
    })
}
