//! The store's update expressions, written once per process: each with its condition and
//! the attribute names both use, read off the text (DynamoDB refuses a name an expression
//! does not use, and one it uses but is not given).

use std::collections::HashMap;
use std::sync::LazyLock;

#[cfg(feature = "admin")]
use super::item::RELEASED_TOKEN;
use super::item::{
    EXPIRATION, EXPIRES_AT, FINGERPRINT, HOLDER, ID, LABEL, LEASE_MS, NAMESPACE, NONCE,
    PRIOR_NONCE, PRIOR_STATE, PRIOR_TOKEN, RENEWED_AT, STATE, STEPS, TOKEN, VALUE, VERSION,
    WRITTEN,
};

/// One `UpdateItem`'s expressions. Every update sets the write's id first (`:written`), so
/// that a write sent again after a lost reply can tell it landed.
pub(super) struct Expression {
    pub(super) update: String,
    pub(super) condition: String,
    names: HashMap<String, String>,
}

/// The name a step's key takes in [`RECORD_STEP`]: its value is the key in hex, per call.
pub(super) const STEP: &str = "#step";

impl Expression {
    /// `update` is a `SET …` clause (and a `REMOVE …` after it, if any).
    fn new(update: &str, condition: String) -> Self {
        let clauses = update
            .strip_prefix("SET ")
            .expect("an update starts with SET");
        let update = format!("SET #{WRITTEN} = :written, {clauses}");
        let names = [&update, &condition]
            .into_iter()
            .flat_map(|text| text.split('#').skip(1))
            .map(|after| {
                let end = after
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(after.len());
                &after[..end]
            })
            .filter(|name| format!("#{name}") != STEP)
            .map(|name| (format!("#{name}"), name.to_owned()))
            .collect();
        Self {
            update,
            condition,
            names,
        }
    }

    /// The attribute names of one request: the expression's, and a step's key in hex.
    pub(super) fn names(&self, step: Option<String>) -> HashMap<String, String> {
        let mut names = self.names.clone();
        if let Some(step) = step {
            names.insert(STEP.to_owned(), step);
        }
        names
    }
}

/// Acts only while the item is in progress under the caller's token.
fn held_by_token() -> String {
    format!("#{STATE} = :in_progress AND #{TOKEN} = :token")
}

/// The claim, with and without a fingerprint, with and without a claim this process has
/// seen unchanged for its whole lease (`:seen_token`, `:seen_version`) to take over.
pub(super) fn claim(fingerprint: bool, lapsed: bool) -> &'static Expression {
    static CLAIMS: LazyLock<[Expression; 4]> = LazyLock::new(|| {
        // The caller's own claim in progress (its answer lost) is taken again by `OWN`,
        // which keeps what the first claim found before it.
        let free = format!(
            "attribute_not_exists(#{ID}) OR #{STATE} IN (:released, :removed) \
             OR (#{STATE} = :completed AND #{EXPIRES_AT} <= :now)"
        );
        // Never the caller's own claim, lapsed while its answer was lost: taken by `OWN`,
        // so that what it found before it is kept (written again here, it would say that
        // the claim took over only itself, and the claim before it, unsettled, would be
        // forgotten).
        let or_lapsed = format!(
            "{free} OR (#{STATE} = :in_progress AND #{TOKEN} = :seen_token \
             AND #{VERSION} = :seen_version AND #{NONCE} <> :nonce)"
        );
        // What the item was (operands read the item before the update): whether the claim
        // takes an unsettled one over.
        let set = format!(
            "SET #{PRIOR_STATE} = if_not_exists(#{STATE}, :none), \
             #{PRIOR_NONCE} = if_not_exists(#{NONCE}, :zero), \
             #{PRIOR_TOKEN} = if_not_exists(#{TOKEN}, :zero), \
             #{STATE} = :in_progress, #{TOKEN} = if_not_exists(#{TOKEN}, :start) + :one, \
             #{VERSION} = if_not_exists(#{VERSION}, :zero) + :one, #{NONCE} = :nonce, \
             #{LEASE_MS} = :lease, #{RENEWED_AT} = :now, #{EXPIRATION} = :expiration, \
             #{STEPS} = if_not_exists(#{STEPS}, :no_steps), #{NAMESPACE} = :namespace, \
             #{LABEL} = :label, #{HOLDER} = :holder"
        );
        let with = format!("{set}, #{FINGERPRINT} = :fingerprint REMOVE #{VALUE}, #{EXPIRES_AT}");
        let without = format!("{set} REMOVE #{VALUE}, #{EXPIRES_AT}, #{FINGERPRINT}");
        [
            Expression::new(&without, free.clone()),
            Expression::new(&without, or_lapsed.clone()),
            Expression::new(&with, free),
            Expression::new(&with, or_lapsed),
        ]
    });
    &CLAIMS[usize::from(fingerprint) * 2 + usize::from(lapsed)]
}

/// The caller's own claim in progress, found again after its answer was lost: taken again
/// under the next token with a whole lease, keeping what the first claim found before it
/// (`prior_*`), so that its answer says whether it took an unsettled claim over.
pub(super) static OWN: LazyLock<Expression> = LazyLock::new(|| {
    let update = format!(
        "SET #{TOKEN} = #{TOKEN} + :one, #{VERSION} = #{VERSION} + :one, \
         #{LEASE_MS} = :lease, #{RENEWED_AT} = :now, #{EXPIRATION} = :expiration, \
         #{NAMESPACE} = :namespace, #{LABEL} = :label, #{HOLDER} = :holder"
    );
    Expression::new(
        &update,
        format!("#{STATE} = :in_progress AND #{NONCE} = :nonce"),
    )
});

pub(super) static COMPLETE: LazyLock<Expression> = LazyLock::new(|| {
    let update = format!(
        "SET #{STATE} = :completed, #{VALUE} = :value, #{EXPIRES_AT} = :expires_at, \
         #{EXPIRATION} = :expiration, #{VERSION} = #{VERSION} + :one \
         REMOVE #{NONCE}, #{LEASE_MS}, #{RENEWED_AT}, #{STEPS}"
    );
    Expression::new(&update, held_by_token())
});

pub(super) static RELEASE: LazyLock<Expression> = LazyLock::new(|| {
    let update = format!(
        "SET #{STATE} = :released, #{VERSION} = #{VERSION} + :one \
         REMOVE #{NONCE}, #{LEASE_MS}, #{RENEWED_AT}, #{FINGERPRINT}"
    );
    Expression::new(&update, held_by_token())
});

/// An operator's release: as [`RELEASE`], and the holder's token kept as released by an
/// operator, so that it claims the item no more to record its result.
#[cfg(feature = "admin")]
fn released_by_operator() -> String {
    format!(
        "SET #{STATE} = :released, #{VERSION} = #{VERSION} + :one, #{RELEASED_TOKEN} = :token \
         REMOVE #{NONCE}, #{LEASE_MS}, #{RENEWED_AT}, #{FINGERPRINT}"
    )
}

/// An operator's release by force.
#[cfg(feature = "admin")]
pub(super) static RELEASE_BY_OPERATOR: LazyLock<Expression> =
    LazyLock::new(|| Expression::new(&released_by_operator(), held_by_token()));

/// An operator's release of a silent holder: only while the item has the version the
/// operator watched unchanged.
#[cfg(feature = "admin")]
pub(super) static RELEASE_UNCHANGED: LazyLock<Expression> = LazyLock::new(|| {
    Expression::new(
        &released_by_operator(),
        format!("{} AND #{VERSION} = :version", held_by_token()),
    )
});

/// An operator's reset of a completed or released call: its value and steps go.
#[cfg(feature = "admin")]
pub(super) static FORGET: LazyLock<Expression> = LazyLock::new(|| {
    let update = format!(
        "SET #{STATE} = :removed, #{VERSION} = #{VERSION} + :one \
         REMOVE #{VALUE}, #{FINGERPRINT}, #{STEPS}, #{EXPIRES_AT}"
    );
    Expression::new(&update, format!("#{STATE} IN (:completed, :released)"))
});

pub(super) static RENEW: LazyLock<Expression> = LazyLock::new(|| {
    let update = format!(
        "SET #{VERSION} = #{VERSION} + :one, #{LEASE_MS} = :lease, #{RENEWED_AT} = :now, \
         #{EXPIRATION} = :expiration"
    );
    Expression::new(&update, held_by_token())
});

pub(super) static RECORD_STEP: LazyLock<Expression> = LazyLock::new(|| {
    let update = format!("SET #{STEPS}.{STEP} = :step, #{EXPIRATION} = :expiration");
    Expression::new(&update, held_by_token())
});

pub(super) static REMOVE: LazyLock<Expression> = LazyLock::new(|| {
    let update = format!(
        "SET #{STATE} = :removed, #{VERSION} = if_not_exists(#{VERSION}, :zero) + :one \
         REMOVE #{VALUE}, #{FINGERPRINT}, #{NONCE}, #{STEPS}, #{LEASE_MS}, #{RENEWED_AT}, #{EXPIRES_AT}"
    );
    Expression::new(&update, format!("attribute_exists(#{ID})"))
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_names_are_read_off_the_expressions() {
        let names = RECORD_STEP.names(Some("ab".into()));
        let mut keys: Vec<_> = names.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "#expiration",
                "#state",
                "#step",
                "#steps",
                "#token",
                "#written"
            ]
        );
        assert_eq!(names["#step"], "ab");
        assert_eq!(names["#steps"], "steps");
        assert!(claim(false, false).names(None).contains_key("#fingerprint"));
        assert!(!claim(true, false).names(None).contains_key("#seen_token"));
    }
}
