//! The store's objects in the database (its table, index, token sequence and the claim
//! function of transactions), and [`migrate`]: create what is absent, and on a current
//! schema take no lock at all.

use sqlx::PgPool;

use super::statements::{InTransaction, Schema};
use crate::Error;

impl Schema {
    /// What is there of the store's objects: the kind of each relation its names name
    /// (`r` table, `S` sequence, `i` index, …), and the claim function's source. Catalog
    /// reads only, which take no lock that a claim could wait behind.
    async fn inspect<'e>(&self, executor: impl sqlx::PgExecutor<'e>) -> Result<Found, Error> {
        let row: (
            Option<String>,
            Option<String>,
            Option<String>,
            Option<String>,
            i64,
        ) = sqlx::query_as(
            "SELECT \
                    (SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)), \
                    (SELECT relkind::text FROM pg_class WHERE oid = to_regclass($2)), \
                    (SELECT relkind::text FROM pg_class WHERE oid = to_regclass($3)), \
                    (SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure($4)), \
                    (SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass($1) \
                        AND attname = ANY($5) AND NOT attisdropped)",
        )
        .bind(&self.quoted)
        .bind(&self.sequence)
        .bind(&self.index)
        .bind(format!("{}(bytea, bytea, bigint, text)", self.function))
        .bind(&ABOUT.map(|(name, _)| name)[..])
        .fetch_one(executor)
        .await
        .map_err(Error::store)?;
        let found = Found {
            table: row.0,
            sequence: row.1,
            index: row.2,
            current_function: row.3.as_deref() == Some(self.function_source.as_str()),
            about: usize::try_from(row.4).unwrap_or(0) == ABOUT.len(),
        };
        self.refuse_clashes(&found)?;
        Ok(found)
    }

    /// A name of ours taken by an object of another kind (a table named like another
    /// store's token sequence, say) would make every call fail later: refused now.
    fn refuse_clashes(&self, found: &Found) -> Result<(), Error> {
        let clashes = [
            (&found.table, &["r", "p"][..], &self.quoted, "table"),
            (
                &found.sequence,
                &["S"][..],
                &self.sequence,
                "token sequence",
            ),
            (&found.index, &["i"][..], &self.index, "expiry index"),
        ];
        for (kind, expected, name, what) in clashes {
            if let Some(kind) = kind.as_deref().filter(|k| !expected.contains(k)) {
                return Err(Error::store(format!(
                    "cannot migrate the idem table {}: its {what} would be {name}, which is already a {} \
                     (another store's table or token sequence?); choose another table name with `with_table`",
                    self.table,
                    relation_kind(kind)
                )));
            }
        }
        Ok(())
    }

    /// The statements that create what `found` lacks.
    fn missing(&self, found: &Found) -> Vec<String> {
        let t = &self.quoted;
        let mut statements = Vec::new();
        if found.table.is_none() {
            statements.push(format!(
                "CREATE TABLE IF NOT EXISTS {t} (\
                    key bytea PRIMARY KEY, \
                    token bigint NOT NULL, \
                    completed boolean NOT NULL, \
                    fingerprint bytea, \
                    value bytea, \
                    expires_at timestamptz NOT NULL, \
                    namespace text, label text, holder text, lease_ms bigint, step boolean, \
                    ttl_ms bigint, taken_over boolean)"
            ));
        } else if !found.about {
            // A table of an earlier version: the columns an operator is shown, added in
            // place (nullable, so no row is rewritten). Its rows list as "namespace unknown".
            let columns: Vec<String> = ABOUT
                .iter()
                .map(|(name, kind)| format!("ADD COLUMN IF NOT EXISTS {name} {kind}"))
                .collect();
            statements.push(format!("ALTER TABLE {t} {}", columns.join(", ")));
        }
        if found.index.is_none() {
            // The index lives in the table's schema: its name is not qualified here.
            let name = self.index.rsplit('.').next().unwrap_or(&self.index);
            statements.push(format!(
                "CREATE INDEX IF NOT EXISTS {name} ON {t} (expires_at)"
            ));
        }
        if found.sequence.is_none() {
            statements.push(format!("CREATE SEQUENCE IF NOT EXISTS {}", self.sequence));
        }
        if !found.current_function {
            statements.push(InTransaction::function(
                &self.function,
                &self.function_source,
            ));
        }
        statements
    }
}

/// What [`Schema::inspect`] found.
struct Found {
    table: Option<String>,
    sequence: Option<String>,
    index: Option<String>,
    current_function: bool,
    /// Whether the table has every column of [`ABOUT`].
    about: bool,
}

/// The columns that say whose a record is, added in place to a table of an earlier version: the claim's
/// namespace, label, holder and lease, whether a row is a step's record, how long a claim
/// that lapsed unsettled is kept (its call's TTL), and whether a claim took one over.
const ABOUT: [(&str, &str); 7] = [
    ("namespace", "text"),
    ("label", "text"),
    ("holder", "text"),
    ("lease_ms", "bigint"),
    ("step", "boolean"),
    ("ttl_ms", "bigint"),
    ("taken_over", "boolean"),
];

fn relation_kind(relkind: &str) -> &'static str {
    match relkind {
        "r" | "p" => "table",
        "S" => "sequence",
        "i" | "I" => "index",
        "v" => "view",
        "m" => "materialized view",
        "f" => "foreign table",
        _ => "relation of another kind",
    }
}

/// Creates what is absent of `schema`'s objects. On a current schema it only reads the
/// catalogs: no DDL, so no lock that an open transaction's claim would hold it behind (and
/// every later claim behind it). Several processes at once are serialised by a
/// transaction-scoped advisory lock, and each looks again under it.
pub(super) async fn migrate(pool: &PgPool, schema: &Schema) -> Result<(), Error> {
    if schema.missing(&schema.inspect(pool).await?).is_empty() {
        return Ok(());
    }
    let mut tx = pool.begin().await.map_err(Error::store)?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(format!("idem.migrate.{}", schema.table))
        .execute(&mut *tx)
        .await
        .map_err(Error::store)?;
    // Looked at again on the transaction's own connection: asking the pool for a second
    // one could wait until the pool timed out, with every connection held by a migration
    // queued on the lock.
    for statement in schema.missing(&schema.inspect(&mut *tx).await?) {
        sqlx::query(&statement)
            .execute(&mut *tx)
            .await
            .map_err(Error::store)?;
    }
    tx.commit().await.map_err(Error::store)
}
