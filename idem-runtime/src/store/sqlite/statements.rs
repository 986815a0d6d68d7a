//! The statements of one table, in SQLite's dialect, written once per store.

use super::NOW;
use crate::store::sql::{is_identifier, Table};
use crate::Error;

/// The statements of one table, written once.
pub(super) struct Statements {
    pub(super) create: [String; 6],
    /// How many of the triggers that keep the token counter ahead of every row exist.
    pub(super) triggers: String,
    /// Whether `triggers` found both, once per store (see [`Statements::checked`]).
    pub(super) checked: tokio::sync::OnceCell<()>,
    pub(super) live: String,
    /// The key's row, whatever its expiry: the one a take left as it was.
    pub(super) held: String,
    pub(super) take: String,
    /// `take` for a claim that runs by itself, outside a transaction: only before a moment
    /// (see [`Statements::of`]).
    pub(super) take_in_time: String,
    pub(super) complete: String,
    pub(super) release: String,
    pub(super) renew: String,
    pub(super) record_step: String,
    pub(super) credit: String,
    pub(super) remove_steps: String,
    pub(super) remove: String,
    /// The table's name, and the reads the core runs itself: a result, a lease, a call's
    /// steps.
    pub(super) table: Table,
    pub(super) purge: String,
    /// The table's column names, and the start of the statement that adds one: a table of
    /// an earlier version lacks those of [`ABOUT`].
    pub(super) about: String,
    pub(super) add_about: String,
}

/// The columns that say whose a record is, added in place to a table of an earlier
/// version: the claim's namespace, label, holder and lease, whether a row is a step's
/// record, how long a claim that lapsed unsettled is kept (its call's TTL), and whether a
/// claim took one over.
pub(super) const ABOUT: [(&str, &str); 7] = [
    ("namespace", "TEXT"),
    ("label", "TEXT"),
    ("holder", "TEXT"),
    ("lease_ms", "INTEGER"),
    ("step", "INTEGER"),
    ("ttl_ms", "INTEGER"),
    ("taken_over", "INTEGER"),
];

impl Statements {
    /// The statements of `table`, after checking the name.
    pub(super) fn new(table: &str) -> Result<Self, Error> {
        Ok(Self::of(validate(table)?))
    }

    /// The statements of a checked table name.
    pub(super) fn of(name: &str) -> Self {
        let t = format!("\"{name}\"");
        let counter = format!("\"{name}_token\"");
        let index = format!("\"{name}_expires_at\"");
        // One statement: the token is the counter's next (the triggers move the counter up
        // to it), and a row is taken over when it lapsed or is the caller's own claim (its
        // nonce in `value`); a live row of another caller is left as it is, and nothing is
        // returned. `row` is where the new row's values come from. It returns the token,
        // and whether the row it replaced was a claim never settled (in progress, and not
        // the caller's own; the caller's own keeps what its lost answer said).
        let take = |row: &str| {
            format!(
                "INSERT INTO {t} (key, token, completed, fingerprint, value, expires_at, \
                    namespace, label, holder, lease_ms, ttl_ms, taken_over) {row} \
                 ON CONFLICT (key) DO UPDATE SET token = excluded.token, completed = 0, \
                 fingerprint = excluded.fingerprint, value = excluded.value, expires_at = excluded.expires_at, \
                 namespace = excluded.namespace, label = excluded.label, holder = excluded.holder, \
                 lease_ms = excluded.lease_ms, step = NULL, ttl_ms = excluded.ttl_ms, \
                 taken_over = (NOT {t}.completed AND (substr({t}.value, 1, 8) IS NOT excluded.value \
                    OR coalesce({t}.taken_over, 0))) \
                 WHERE {t}.expires_at <= {NOW} \
                    OR (NOT {t}.completed AND substr({t}.value, 1, 8) = excluded.value) \
                 RETURNING token, taken_over"
            )
        };
        // The key, fingerprint, lease and nonce, then the claimant's namespace, label and
        // holder, then the call's TTL (`ttl`, a parameter).
        let values = |ttl: &str| {
            format!(
                "?1, (SELECT last + 1 FROM {counter} WHERE id = 1), 0, ?2, ?4, {NOW} + ?3, ?5, ?6, ?7, ?3, {ttl}, 0"
            )
        };
        let insert_trigger = format!("\"{name}_token_inserted\"");
        let update_trigger = format!("\"{name}_token_updated\"");
        Self {
            create: [
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                        key BLOB PRIMARY KEY NOT NULL, \
                        token INTEGER NOT NULL, \
                        completed INTEGER NOT NULL, \
                        fingerprint BLOB, \
                        value BLOB, \
                        expires_at INTEGER NOT NULL, \
                        namespace TEXT, label TEXT, holder TEXT, lease_ms INTEGER, step INTEGER, \
                        ttl_ms INTEGER, taken_over INTEGER) \
                     WITHOUT ROWID"
                ),
                format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (expires_at)"),
                format!(
                    "CREATE TABLE IF NOT EXISTS {counter} (\
                        id INTEGER PRIMARY KEY CHECK (id = 1), last INTEGER NOT NULL)"
                ),
                format!("INSERT OR IGNORE INTO {counter} (id, last) VALUES (1, 0)"),
                // A take draws its token from the counter in its own statement; these move the
                // counter up to every token a row is given, inside that statement.
                format!(
                    "CREATE TRIGGER IF NOT EXISTS {insert_trigger} AFTER INSERT ON {t} BEGIN \
                     UPDATE {counter} SET last = NEW.token WHERE id = 1 AND last < NEW.token; END"
                ),
                format!(
                    "CREATE TRIGGER IF NOT EXISTS {update_trigger} AFTER UPDATE OF token ON {t} BEGIN \
                     UPDATE {counter} SET last = NEW.token WHERE id = 1 AND last < NEW.token; END"
                ),
            ],
            // SQLite's names are case-insensitive: `IDEM_RECORDS` is `idem_records`, whose
            // triggers a migrate of either name made.
            triggers: format!(
                "SELECT count(*) FROM sqlite_master WHERE type = 'trigger' \
                 AND tbl_name = '{name}' COLLATE NOCASE \
                 AND name COLLATE NOCASE IN ('{name}_token_inserted', '{name}_token_updated')"
            ),
            checked: tokio::sync::OnceCell::new(),
            live: format!(
                "SELECT token, completed, fingerprint, value FROM {t} \
                 WHERE key = ?1 AND expires_at > {NOW}"
            ),
            held: format!("SELECT token, completed, fingerprint, value FROM {t} WHERE key = ?1"),
            take: take(&format!("VALUES ({})", values("?8"))),
            // `NOW` is read once the statement holds the file's write lock: it writes
            // nothing unless that is before `?8`, when its caller stops waiting or would
            // have waited long enough that leases get time back first (see `writes.rs`).
            take_in_time: take(&format!("SELECT {} WHERE {NOW} < ?8", values("?9"))),
            // The holder's own statements ask for its token in the row, not for a live lease:
            // a lease that ran out while nobody took the key over is still the holder's (a
            // takeover writes another token), so a renewal or a completion that was held up
            // past the lease still lands.
            complete: format!(
                "UPDATE {t} SET completed = 1, value = ?3, expires_at = {NOW} + ?4 \
                 WHERE key = ?1 AND token = ?2 AND NOT completed"
            ),
            release: format!("DELETE FROM {t} WHERE key = ?1 AND token = ?2 AND NOT completed"),
            // A renewal clears the mark of time given back (see `credit`): the holder is alive.
            renew: format!(
                "UPDATE {t} SET expires_at = {NOW} + ?3, value = substr(value, 1, 8) \
                 WHERE key = ?1 AND token = ?2 AND NOT completed"
            ),
            // Like `complete`, it asks for the holder's token in the call's row, not for a
            // live lease: a takeover writes another token.
            record_step: format!(
                "INSERT INTO {t} (key, token, completed, fingerprint, value, expires_at, step) \
                 SELECT ?5, token, 1, NULL, ?3, {NOW} + ?4, 1 FROM {t} \
                 WHERE key = ?1 AND token = ?2 AND NOT completed \
                 ON CONFLICT (key) DO UPDATE SET token = excluded.token, completed = 1, \
                 fingerprint = NULL, value = excluded.value, expires_at = excluded.expires_at, step = 1"
            ),
            // The dark time `?1` given back to the claims in progress whose lease ran out
            // within it or runs out within a lease `?2`, to a lease from now at most, once: a
            // claim's value is its nonce (8 bytes), and a ninth byte marks it as given time
            // back until its holder renews.
            credit: format!(
                "UPDATE {t} SET expires_at = {NOW} + ?1, value = value || X'01' \
                 WHERE NOT completed AND length(value) = 8 \
                 AND expires_at > {NOW} - ?2 AND expires_at < {NOW} + ?1"
            ),
            table: Table {
                name: name.to_string(),
                steps: format!(
                    "SELECT key, value FROM {t} \
                     WHERE key BETWEEN ?2 AND ?3 AND key <> ?1 AND completed AND expires_at > {NOW}"
                ),
                // Rounded down: `NOW` truncates to the millisecond, so the difference could be a
                // fraction over what is left, and a copy must never outlive the row.
                lookup: format!(
                    "SELECT fingerprint, value, expires_at - {NOW} - 1 FROM {t} \
                     WHERE key = ?1 AND completed AND expires_at > {NOW}"
                ),
                lease_left: format!(
                    "SELECT expires_at - {NOW} FROM {t} \
                     WHERE key = ?1 AND NOT completed AND expires_at > {NOW}"
                ),
                holding: format!(
                    "SELECT expires_at - {NOW}, holder FROM {t} \
                     WHERE key = ?1 AND NOT completed AND expires_at > {NOW}"
                ),
                released: format!("SELECT token FROM {t} WHERE key = ?1 AND step = 1"),
                #[cfg(feature = "admin")]
                admin: admin(&t),
            },
            about: format!("SELECT name FROM pragma_table_info('{name}')"),
            add_about: format!("ALTER TABLE {t} ADD COLUMN "),
            remove_steps: format!("DELETE FROM {t} WHERE key BETWEEN ?2 AND ?3 AND key <> ?1"),
            remove: format!("DELETE FROM {t} WHERE key = ?1 RETURNING expires_at > {NOW}"),
            // A claim that lapsed unsettled stays for its call's TTL, so that the claim
            // taking it over is told.
            purge: format!(
                "DELETE FROM {t} WHERE key IN \
                 (SELECT key FROM {t} WHERE expires_at <= {NOW} \
                    AND (completed OR expires_at + coalesce(ttl_ms, 0) <= {NOW}) LIMIT ?1)"
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
        key: "key",
        param: |n| format!("?{n}"),
        live: &format!("expires_at > {NOW}"),
        now: NOW,
        left_ms: &format!("expires_at - {NOW}"),
        size: "length(value)",
        head: "substr(value, 1, 1)",
        not_step: "coalesce(step, 0) = 0",
        prefix: |len, prefix| format!("substr(coalesce(namespace, ''), 1, {len}) = {prefix}"),
        token_is: |token| format!("abs(token) = {token}"),
        silent: &format!("(expires_at <= {NOW} OR (expires_at - {NOW}) * 2 < lease_ms)"),
        trace: &format!(
            "INSERT INTO {t} (key, token, completed, expires_at, step) \
             VALUES (?1, ?2, 1, {NOW} + 86400000, 1) \
             ON CONFLICT(key) DO UPDATE SET token = excluded.token, expires_at = excluded.expires_at"
        ),
    })
}

/// A table name: a plain identifier, so that it can never inject SQL.
fn validate(identifier: &str) -> Result<&str, Error> {
    if is_identifier(identifier) {
        Ok(identifier)
    } else {
        Err(Error::store(format!(
            "invalid table name {identifier:?}: use letters, digits and `_` (at most 50, not starting with a digit)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sqlite::DEFAULT_TABLE;

    #[test]
    fn table_names_are_identifiers_only() {
        assert!(Statements::new(DEFAULT_TABLE).is_ok());
        for bad in [
            "",
            "1table",
            "idem records",
            "t\"; DROP TABLE x; --",
            "main.t",
            &"x".repeat(51),
        ] {
            assert!(Statements::new(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
