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
    pub(super) create: [String; 5],
    /// Draws a token: the insert's id, also the connection's `LAST_INSERT_ID()` (see
    /// [`Statements::of`]).
    pub(super) draw: String,
    pub(super) live: String,
    pub(super) insert: String,
    pub(super) lock: String,
    /// The key's row under a shared lock, for claims in the caller's transaction.
    pub(super) share: String,
    pub(super) take: String,
    pub(super) complete: String,
    pub(super) release: String,
    pub(super) renew: String,
    pub(super) remove_lock: String,
    pub(super) remove: String,
    pub(super) lookup: String,
    pub(super) lease_left: String,
    /// A batch of expired rows' keys, and the start of the statement that deletes them.
    pub(super) expired: String,
    pub(super) delete_expired: String,
    /// A batch of the token table's rows below its newest, and the start of the statement
    /// that deletes them.
    pub(super) old_tokens: String,
    pub(super) delete_tokens: String,
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

    /// The first claim, in the caller's transaction, of a key that has no row, as one
    /// message: a token drawn, and the row inserted with it unless one is there. Its one row
    /// of answer: whether the row was inserted (1 or 0), and the token. (No nonce: a claim
    /// in a transaction is never taken again by its own caller.)
    pub(super) fn insert_message(
        &self,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> String {
        format!(
            "{}; INSERT IGNORE INTO `{}` (`key`, token, completed, fingerprint, value, expires_at) \
             VALUES (X'{}', LAST_INSERT_ID(), FALSE, {}, NULL, {NOW} + {}); \
             SELECT CAST(ROW_COUNT() AS SIGNED), CAST(LAST_INSERT_ID() AS SIGNED)",
            self.draw,
            self.table,
            hex::encode(key.as_bytes()),
            fingerprint_literal(fingerprint),
            millis(lease)
        )
    }

    /// The takeover, in the caller's transaction, of the key's row, which that transaction
    /// has locked, as one message: a token drawn after the lock (so above the row's), and
    /// the row rewritten with it. Its one row of answer: the token.
    pub(super) fn take_message(
        &self,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> String {
        format!(
            "{}; UPDATE `{}` SET token = LAST_INSERT_ID(), completed = FALSE, fingerprint = {}, \
             value = NULL, expires_at = {NOW} + {} WHERE `key` = X'{}'; \
             SELECT CAST(LAST_INSERT_ID() AS SIGNED)",
            self.draw,
            self.table,
            fingerprint_literal(fingerprint),
            millis(lease),
            hex::encode(key.as_bytes())
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
        let counter = format!("`{name}_token`");
        let tokens = format!("`{name}_tokens`");
        let index = format!("`{name}_expires_at`");
        let live_row = format!("`key` = ? AND expires_at > {NOW}");
        Self {
            table: name.to_string(),
            create: [
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                        `key` VARBINARY(32) NOT NULL PRIMARY KEY, \
                        token BIGINT NOT NULL, \
                        completed BOOLEAN NOT NULL, \
                        fingerprint VARBINARY(32) NULL, \
                        value LONGBLOB NULL, \
                        expires_at BIGINT NOT NULL, \
                        INDEX {index} (expires_at)) ENGINE = InnoDB"
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {counter} (\
                        id TINYINT NOT NULL PRIMARY KEY, last BIGINT NOT NULL) ENGINE = InnoDB"
                ),
                format!("INSERT IGNORE INTO {counter} (id, last) VALUES (1, 0)"),
                format!(
                    "CREATE TABLE IF NOT EXISTS {tokens} (\
                        id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY) ENGINE = InnoDB"
                ),
                // A table made by an earlier version drew its tokens from the counter: the
                // tokens drawn from now on start above its last.
                format!(
                    "INSERT IGNORE INTO {tokens} (id) SELECT last FROM {counter} WHERE id = 1 AND last > 0"
                ),
            ],
            // A row of the token table takes the next value of its AUTO_INCREMENT, which
            // only grows (InnoDB keeps it across restarts). The insert waits for no other
            // transaction: the AUTO_INCREMENT lock is released at the end of the statement,
            // and the row is the drawer's own. So a token drawn inside a transaction (a
            // takeover, or a claim in the caller's) costs no commit of its own, and that
            // transaction holds no lock other claims need. The rows are deleted by the purge.
            draw: format!("INSERT INTO {tokens} () VALUES ()"),
            live: format!("SELECT token, completed, fingerprint, value FROM {t} WHERE {live_row}"),
            insert: format!(
                "INSERT IGNORE INTO {t} (`key`, token, completed, fingerprint, value, expires_at) \
                 VALUES (?, ?, FALSE, ?, ?, {NOW} + ?)"
            ),
            lock: format!(
                "SELECT token, completed, fingerprint, value, expires_at > {NOW} FROM {t} \
                 WHERE `key` = ? FOR UPDATE"
            ),
            share: format!(
                "SELECT token, completed, fingerprint, value, expires_at > {NOW} FROM {t} \
                 WHERE `key` = ? LOCK IN SHARE MODE"
            ),
            take: format!(
                "UPDATE {t} SET token = ?, completed = FALSE, fingerprint = ?, value = ?, \
                 expires_at = {NOW} + ? WHERE `key` = ?"
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
            remove_lock: format!("SELECT expires_at > {NOW} FROM {t} WHERE `key` = ? FOR UPDATE"),
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
            // Every row but the newest, which keeps the AUTO_INCREMENT however the server
            // treats an empty table. Rows of open transactions are not seen, and left.
            old_tokens: format!(
                "SELECT id FROM {tokens} WHERE id < (SELECT MAX(id) FROM {tokens}) \
                 ORDER BY id LIMIT {PURGE_BATCH}"
            ),
            delete_tokens: format!("DELETE FROM {tokens} WHERE id IN "),
        }
    }
}

/// A fingerprint as an SQL literal: its bytes in hex, or `NULL`.
fn fingerprint_literal(fingerprint: Option<&Fingerprint>) -> String {
    fingerprint.map_or("NULL".to_string(), |f| {
        format!("X'{}'", hex::encode(f.as_bytes()))
    })
}
