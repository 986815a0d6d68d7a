//! The statements of one table, in PostgreSQL's dialect, written once per store.

use crate::store::sql::{is_identifier, Table};
use crate::store::transaction::Savepoint;
use crate::{Error, Fingerprint, Key};

/// The statements of one table, written once.
pub(super) struct Statements {
    pub(super) schema: Schema,
    /// The ordinary claim: the fast one first, then the whole one ([`ordinary_claim`]).
    pub(super) claim: [String; 2],
    /// The statements of claims in the caller's transaction (`transaction.rs`).
    pub(super) transaction: InTransaction,
    pub(super) complete: String,
    pub(super) release: String,
    pub(super) renew: String,
    pub(super) record_step: String,
    /// The table's name, and the reads the core runs itself: a result, a lease, a call's
    /// steps.
    pub(super) table: Table,
    pub(super) remove: String,
    pub(super) purge: String,
    /// The channel on which a removal of a completed record is told (`pg_notify`), for the
    /// tiers in front of this table ([`Store::watch_removals`](crate::Store::watch_removals)).
    pub(super) removals: String,
}

impl Statements {
    /// The statements of `table` (`name` or `schema.name`), after checking the name.
    pub(super) fn new(table: &str) -> Result<Self, Error> {
        Ok(match table.split_once('.') {
            Some((schema, name)) => Self::of(Some(validate(schema)?), validate(name)?),
            None => Self::of(None, validate(table)?),
        })
    }

    /// The statements of a checked table name.
    pub(super) fn of(schema: Option<&str>, name: &str) -> Self {
        let objects = Schema::new(schema, name);
        let t = objects.quoted.clone();
        let sequence = objects.sequence.clone();
        let function = objects.function.clone();
        let removals = removals_channel(&objects.table);
        let told = format!("pg_notify('{removals}', encode(key, 'hex'))");
        Self {
            transaction: InTransaction::new(&function, &t),
            claim: [
                ordinary_claim(&t, &sequence, Conflict::Skip),
                ordinary_claim(&t, &sequence, Conflict::TakeOver),
            ],
            complete: format!(
                "UPDATE {t} SET completed = true, value = $3, expires_at = now() + $4 * interval '1 millisecond' \
                 WHERE key = $1 AND token = $2 AND NOT completed AND expires_at > now()"
            ),
            release: format!(
                "DELETE FROM {t} WHERE key = $1 AND token = $2 AND NOT completed AND expires_at > now()"
            ),
            renew: format!(
                "UPDATE {t} SET expires_at = now() + $3 * interval '1 millisecond' \
                 WHERE key = $1 AND token = $2 AND NOT completed AND expires_at > now()"
            ),
            // The call's row is locked (`FOR SHARE`) by the statement that reads it, so a
            // takeover waits for the step's record, or the record finds the new token.
            record_step: format!(
                "WITH held AS (\
                    SELECT token FROM {t} \
                    WHERE key = $1 AND token = $2 AND NOT completed AND expires_at > now() FOR SHARE) \
                 INSERT INTO {t} (key, token, completed, fingerprint, value, expires_at, step) \
                 SELECT $5, token, true, NULL, $3, now() + $4 * interval '1 millisecond', true FROM held \
                 ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token, completed = true, \
                    fingerprint = NULL, value = EXCLUDED.value, expires_at = EXCLUDED.expires_at, step = true"
            ),
            table: Table {
                name: objects.table.clone(),
                steps: format!(
                    "SELECT key, value FROM {t} \
                     WHERE key BETWEEN $2 AND $3 AND key <> $1 AND completed AND expires_at > now()"
                ),
                // Rounded down: the time a copy of the record may live must not exceed the row's.
                lookup: format!(
                    "SELECT fingerprint, value, floor(extract(epoch FROM expires_at - now()) * 1000)::bigint \
                     FROM {t} WHERE key = $1 AND completed AND expires_at > now()"
                ),
                // Rounded up: a client told to come back then finds the lease over.
                lease_left: format!(
                    "SELECT ceil(extract(epoch FROM expires_at - now()) * 1000)::bigint \
                     FROM {t} WHERE key = $1 AND NOT completed AND expires_at > now()"
                ),
                holding: format!(
                    "SELECT ceil(extract(epoch FROM expires_at - now()) * 1000)::bigint, holder \
                     FROM {t} WHERE key = $1 AND NOT completed AND expires_at > now()"
                ),
                released: format!("SELECT token FROM {t} WHERE key = $1 AND step IS TRUE"),
                #[cfg(feature = "admin")]
                admin: admin(&t, &told),
            },
            // A completed record removed is told to the tiers in front of the table, in the
            // statement's own transaction (the `WHERE` makes the server run `told`).
            remove: format!(
                "WITH steps AS (DELETE FROM {t} WHERE key BETWEEN $2 AND $3 AND key <> $1), \
                 removed AS (DELETE FROM {t} WHERE key = $1 RETURNING key, completed, expires_at > now() AS live), \
                 told AS (SELECT {told} FROM removed WHERE completed) \
                 SELECT coalesce(bool_or(live), false) FROM removed WHERE (SELECT count(*) FROM told) >= 0"
            ),
            // One batch: expired rows that no one holds a lock on (a claim taking an expired
            // key over, say) are skipped, never waited for. A claim that lapsed unsettled
            // stays for its call's TTL, so that the claim taking it over is told.
            purge: format!(
                "DELETE FROM {t} WHERE key = ANY(ARRAY(\
                    SELECT key FROM {t} WHERE expires_at <= now() \
                    AND (completed OR expires_at + coalesce(ttl_ms, 0) * interval '1 millisecond' <= now()) \
                    LIMIT $1 FOR UPDATE SKIP LOCKED))"
            ),
            schema: objects,
            removals,
        }
    }
}

/// The channel on which removals from the table `table` (as the user named it) are told:
/// a name of its own per table, short of PostgreSQL's 63 bytes, which nothing needs to
/// quote.
fn removals_channel(table: &str) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(table.as_bytes());
    format!("idem_removed_{}", hex::encode(&digest[..8]))
}

/// What a claim's insert does with a row of the key that is not live.
#[derive(Clone, Copy)]
pub(super) enum Conflict {
    /// Takes it over when it is expired (or, with a nonce, the caller's own).
    TakeOver,
    /// Leaves it: the statement then returns nothing.
    Skip,
}

/// The claim: one statement that returns the live row if there is one (a replay or a held
/// key writes nothing), and otherwise takes the key (absent, or its row expired). A row
/// inserted by a concurrent claim after this statement's snapshot is in neither branch:
/// the statement then returns nothing, and is asked once more.
///
/// `now` is how the statement reads the clock, `params` the key, the fingerprint and the
/// lease in milliseconds, `about` the claimant's namespace, label and holder (what an
/// operator is shown; the lease is kept beside them). With [`Conflict::Skip`], a key that has a row which is not live
/// is not taken over: the statement returns nothing, as in the race above (the fast claim
/// of [`ordinary_claim`]). With a `nonce` (ordinary claims), an in-progress row keeps it in
/// its `value` (empty until the row completes), and a row in progress under this very
/// nonce is the caller's own claim, made by a try whose reply was lost: it is taken again
/// like a lapsed one, with a new token and a whole lease, so the caller never holds a claim
/// whose lease was spent while the reply was lost.
///
/// With a `ttl` (ordinary claims, milliseconds), the row keeps it (`ttl_ms`: how long the
/// purge leaves the row once its lease ran out unsettled) and whether the claim took over a
/// row in progress that was not the caller's own (`taken_over`, written from the row it
/// replaced), which the statement returns as a sixth column.
#[allow(clippy::too_many_arguments)]
pub(super) fn claim_query(
    t: &str,
    sequence: &str,
    now: &str,
    params: [&str; 3],
    nonce: Option<&str>,
    ttl: Option<&str>,
    about: [&str; 3],
    conflict: Conflict,
) -> String {
    let [key, fingerprint, lease] = params;
    let [namespace, label, holder] = about;
    let (value, not_ours, ours) = match nonce {
        Some(nonce) => (
            nonce.to_string(),
            format!(" AND (completed OR value IS DISTINCT FROM {nonce})"),
            format!(" OR (NOT r.completed AND r.value = {nonce})"),
        ),
        None => ("NULL".to_string(), String::new(), String::new()),
    };
    // Whether the row replaced was a claim that was never settled: in progress, and not
    // the caller's own (whose lost answer said, and whose row keeps, whether it took one
    // over itself).
    let unsettled = format!(
        "NOT r.completed{}",
        nonce.map_or(String::new(), |nonce| format!(
            " AND (r.value IS DISTINCT FROM {nonce} OR coalesce(r.taken_over, false))"
        ))
    );
    let (ttl_column, ttl_value, ttl_update, taken_over, not_taken) = match ttl {
        Some(ttl) => (
            ", ttl_ms, taken_over",
            format!(", {ttl}, false"),
            format!(", ttl_ms = EXCLUDED.ttl_ms, taken_over = {unsettled}"),
            ", taken_over",
            ", false",
        ),
        None => ("", String::new(), String::new(), "", ""),
    };
    let on_conflict = match conflict {
        Conflict::TakeOver => format!(
            "DO UPDATE SET \
                token = EXCLUDED.token, completed = false, fingerprint = EXCLUDED.fingerprint, \
                value = EXCLUDED.value, expires_at = EXCLUDED.expires_at, \
                namespace = EXCLUDED.namespace, label = EXCLUDED.label, holder = EXCLUDED.holder, \
                lease_ms = EXCLUDED.lease_ms, step = NULL{ttl_update} \
            WHERE r.expires_at <= {now}{ours}"
        ),
        Conflict::Skip => "DO NOTHING".to_string(),
    };
    format!(
        "WITH live AS (\
            SELECT token, completed, fingerprint, value FROM {t} \
            WHERE key = {key} AND expires_at > {now}{not_ours}), \
         claimed AS (\
            INSERT INTO {t} AS r (key, token, completed, fingerprint, value, expires_at, namespace, label, holder, lease_ms{ttl_column}) \
            SELECT {key}, nextval('{sequence}'), false, {fingerprint}, {value}, {now} + {lease} * interval '1 millisecond', \
                {namespace}, {label}, {holder}, {lease}{ttl_value} \
            WHERE NOT EXISTS (SELECT 1 FROM live) \
            ON CONFLICT (key) {on_conflict} \
            RETURNING r.token, r.completed, r.fingerprint, r.value{taken_over}) \
         SELECT true, token, completed, fingerprint, value{taken_over} FROM claimed \
         UNION ALL \
         SELECT false, token, completed, fingerprint, value{not_taken} FROM live"
    )
}

/// The claim of an ordinary call. Its only wait is for a row lock: a claim of the same key
/// inserted by an open transaction (`run_in_transaction`). That wait is bounded on the
/// server by `lock_timeout`, set for this statement only (`$4` milliseconds, within the
/// client's own timeout), before the insert runs: a server still waiting after the client
/// gave up would insert a claim nobody holds, and block the key for its lease.
///
/// An ordinary claim sends the statement with [`Conflict::Skip`] first: a replay, a held
/// key and a fresh key (almost every call) are settled by it, and it costs the server less
/// than the whole claim even when the insert does nothing (`BENCHMARKS.md`, throughput:
/// PostgreSQL plans and starts the `DO UPDATE` branch whether or not it runs). Only a key
/// whose row is not live (expired, or in progress under the caller's own nonce), or a race
/// with a concurrent claim, needs the whole claim after it.
fn ordinary_claim(t: &str, sequence: &str, conflict: Conflict) -> String {
    claim_query(
        t,
        sequence,
        "now()",
        ["$1", "$2", "$3"],
        Some("$5"),
        Some("$9"),
        ["$6", "$7", "$8"],
        conflict,
    )
    .replacen(
        "WHERE NOT EXISTS (SELECT 1 FROM live)",
        "WHERE NOT EXISTS (SELECT 1 FROM live) \
         AND (SELECT set_config('lock_timeout', $4::text, true)) IS NOT NULL",
        1,
    )
}

/// The statements of an operator ([`Admin`](crate::admin::Admin)) on the table `t`; a
/// completed record forgotten is told with `told`.
#[cfg(feature = "admin")]
fn admin(t: &str, told: &str) -> crate::store::sql::AdminSql {
    crate::store::sql::AdminSql::new(&crate::store::sql::Spelling {
        told: Some(told),
        table: t,
        key: "key",
        param: |n| format!("${n}"),
        live: "expires_at > now()",
        now: "now()",
        left_ms: "ceil(extract(epoch FROM expires_at - now()) * 1000)::bigint",
        size: "octet_length(value)::bigint",
        head: "substring(value FROM 1 FOR 1)",
        not_step: "step IS NOT TRUE",
        prefix: |len, prefix| {
            format!("substr(coalesce(namespace, ''), 1, {len}::integer) = {prefix}::text")
        },
        token_is: |token| format!("abs(token) = {token}"),
        silent: "(expires_at <= now() \
                 OR (expires_at - now()) * 2 < lease_ms * interval '1 millisecond')",
        trace: &format!(
            "INSERT INTO {t} (key, token, completed, expires_at, step) \
             VALUES ($1, $2, true, now() + interval '1 day', true) \
             ON CONFLICT (key) DO UPDATE SET token = excluded.token, expires_at = excluded.expires_at"
        ),
    })
}

/// A table or schema name: a plain identifier, so that it can never inject SQL.
pub(super) fn validate(identifier: &str) -> Result<&str, Error> {
    if is_identifier(identifier) {
        Ok(identifier)
    } else {
        Err(Error::store(format!(
            "invalid table name {identifier:?}: use letters, digits and `_` (at most 50, not starting with a digit), optionally `schema.table`"
        )))
    }
}

/// The names of one store's objects, quoted and qualified as statements use them, and the
/// statements that create them.
pub(super) struct Schema {
    /// The table as the user named it (`name` or `schema.name`), for messages.
    pub(super) table: String,
    /// The table, quoted.
    pub(super) quoted: String,
    pub(super) sequence: String,
    pub(super) index: String,
    pub(super) function: String,
    /// The claim function's source, as `migrate` creates it: a function whose source
    /// differs is replaced.
    pub(super) function_source: String,
}

impl Schema {
    pub(super) fn new(schema: Option<&str>, name: &str) -> Self {
        let table = match schema {
            Some(schema) => format!("{schema}.{name}"),
            None => name.to_string(),
        };
        let qualify = |object: &str| match schema {
            Some(schema) => format!("\"{schema}\".\"{object}\""),
            None => format!("\"{object}\""),
        };
        let quoted = qualify(name);
        let sequence = qualify(&format!("{name}_token"));
        let function = qualify(&format!("{name}_claim_in_transaction"));
        let function_source = InTransaction::function_source(&quoted, &sequence);
        Self {
            table,
            quoted,
            sequence,
            index: qualify(&format!("{name}_expires_at")),
            function,
            function_source,
        }
    }
}

/// The statements of claims in a transaction, for one table.
pub(super) struct InTransaction {
    function: String,
    pub(super) claim: String,
    table: String,
}

impl InTransaction {
    /// The statements for `table`, whose claim function is `function`.
    pub(super) fn new(function: &str, table: &str) -> Self {
        Self {
            function: function.to_string(),
            claim: format!("SELECT * FROM {function}($1, $2, $3, $4)"),
            table: table.to_string(),
        }
    }

    /// The completion, and the release of the call's savepoint, in one message: the row is
    /// this transaction's own, invisible to others until commit, so there is no expiry to
    /// check; the TTL starts at the completion. Released, the savepoint's work joins the
    /// enclosing level, so that calls after it do not nest one level deeper each.
    pub(super) fn complete_and_release(
        &self,
        savepoint: &Savepoint,
        key: &Key,
        token: i64,
        record: &[u8],
        ttl: i64,
    ) -> String {
        format!(
            "UPDATE {} SET completed = true, value = decode('{}', 'hex'), \
             expires_at = clock_timestamp() + {ttl} * interval '1 millisecond' \
             WHERE key = decode('{}', 'hex') AND token = {token} AND NOT completed RETURNING true; \
             RELEASE SAVEPOINT {savepoint}",
            self.table,
            hex::encode(record),
            hex::encode(key.as_bytes()),
        )
    }

    /// The first claim of a call: its savepoint, then the claim, in one message. The
    /// arguments are literals: the key and the fingerprint in hex, the numbers as digits.
    pub(super) fn savepoint_and_claim(
        &self,
        savepoint: &Savepoint,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: i64,
        lock_timeout: &str,
    ) -> String {
        let fingerprint = fingerprint.map_or("NULL".to_string(), |f| {
            format!("decode('{}', 'hex')", hex::encode(f.as_bytes()))
        });
        format!(
            "SAVEPOINT {savepoint}; SELECT * FROM {}(decode('{}', 'hex'), {fingerprint}, {lease}, '{lock_timeout}')",
            self.function,
            hex::encode(key.as_bytes()),
        )
    }

    /// The body of the claim function (see [`function`](Self::function)): the store's claim
    /// with the transaction's clock (`clock_timestamp()`, as `now()` is when the
    /// transaction began), under the `lock_timeout` it is handed.
    ///
    /// A key without a row, as almost every key a transaction claims, is taken by a plain
    /// `INSERT … ON CONFLICT DO NOTHING` first, cheaper on the server than the whole claim
    /// (`BENCHMARKS.md`, P12a). Like the whole claim's insert, it waits for a concurrent
    /// transaction that inserted the key to end. A key with a row of any kind (live,
    /// completed, or expired and to be taken over) inserts nothing there and goes through
    /// the whole claim, whose own statement sees a row committed meanwhile. The token is
    /// drawn even when nothing is inserted: tokens only have to grow.
    pub(super) fn function_source(table: &str, sequence: &str) -> String {
        let claim = super::statements::claim_query(
            table,
            sequence,
            "clock_timestamp()",
            ["p_key", "p_fingerprint", "p_lease"],
            None,
            None,
            ["NULL::text", "NULL::text", "NULL::text"],
            super::statements::Conflict::TakeOver,
        );
        format!(
            "\n#variable_conflict use_column\n\
             DECLARE taken bigint;\n\
             BEGIN\n\
                 PERFORM set_config('lock_timeout', p_lock_timeout, true);\n\
                 INSERT INTO {table} (key, token, completed, fingerprint, value, expires_at, lease_ms) \
                     VALUES (p_key, nextval('{sequence}'), false, p_fingerprint, NULL, \
                     clock_timestamp() + p_lease * interval '1 millisecond', p_lease) \
                     ON CONFLICT (key) DO NOTHING RETURNING token INTO taken;\n\
                 IF taken IS NOT NULL THEN\n\
                     RETURN QUERY SELECT true, taken, false, p_fingerprint, NULL::bytea;\n\
                     RETURN;\n\
                 END IF;\n\
                 FOR attempt IN 1..1000 LOOP\n\
                     RETURN QUERY {claim};\n\
                     IF FOUND THEN RETURN; END IF;\n\
                 END LOOP;\n\
                 RAISE EXCEPTION 'idem: the claim of a key did not settle after 1000 attempts';\n\
             END\n"
        )
    }

    /// The claim function, of `source`. Its own `SET` clause puts the caller's
    /// `lock_timeout` back when it returns. A lock wait that runs out fails the statement
    /// (`lock_not_available`), and the caller rolls back to the savepoint the claim was sent
    /// after.
    pub(super) fn function(function: &str, source: &str) -> String {
        format!(
            "CREATE OR REPLACE FUNCTION {function}(\
                p_key bytea, p_fingerprint bytea, p_lease bigint, p_lock_timeout text) \
             RETURNS TABLE (acquired boolean, token bigint, completed boolean, fingerprint bytea, value bytea) \
             LANGUAGE plpgsql SET lock_timeout = 0 AS $idem${source}$idem$"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::postgres::DEFAULT_TABLE;
    #[test]
    fn table_names_are_identifiers_only() {
        assert!(Statements::new("idem_records").is_ok());
        assert!(Statements::new("billing.idem_v2").is_ok());
        for bad in [
            "",
            "1table",
            "idem records",
            "t\"; DROP TABLE x; --",
            "a.b.c",
            "a-b",
            &"x".repeat(51),
        ] {
            assert!(Statements::new(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn the_default_table_name_is_valid() {
        assert!(validate(DEFAULT_TABLE).is_ok());
    }

    #[test]
    fn statements_quote_the_checked_name() {
        let sql = Statements::new("billing.idem").unwrap();
        for claim in &sql.claim {
            assert!(claim.contains("\"billing\".\"idem\""));
            assert!(claim.contains("nextval('\"billing\".\"idem_token\"')"));
        }
    }
}
