//! Parsing `#[idempotent(...)]` arguments.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, Lit, LitStr, Path, Token};

mod kw {
    syn::custom_keyword!(key);
    syn::custom_keyword!(store);
    syn::custom_keyword!(ttl);
    syn::custom_keyword!(lease);
    syn::custom_keyword!(namespace);
    syn::custom_keyword!(fingerprint);
    syn::custom_keyword!(in_flight);
    syn::custom_keyword!(wait);
    syn::custom_keyword!(cache_err);
    syn::custom_keyword!(on_cancel);
    syn::custom_keyword!(transaction);
    syn::custom_keyword!(ignore);
    syn::custom_keyword!(label);
    syn::custom_keyword!(reconcile);
}

const NAMES: &[&str] = &[
    "key",
    "store",
    "ttl",
    "lease",
    "namespace",
    "fingerprint",
    "in_flight",
    "wait",
    "cache_err",
    "on_cancel",
    "transaction",
    "ignore",
    "label",
    "reconcile",
    "crate",
];

/// The parsed arguments. Everything but `key` is optional; defaults are applied in `expand`.
pub(crate) struct Args {
    pub key: Option<Expr>,
    pub store: Option<Expr>,
    pub ttl: Option<Duration>,
    pub lease: Option<Duration>,
    pub namespace: Option<LitStr>,
    pub fingerprint: Option<Expr>,
    pub in_flight: Option<InFlight>,
    /// How long a duplicate waits for the holder before `Error::InProgress`.
    pub wait: Option<Duration>,
    pub cache_err: Option<Expr>,
    pub on_cancel: Option<OnCancel>,
    /// The parameter that is the caller's PostgreSQL connection, and the keyword's span.
    pub transaction: Option<(syn::Ident, Span)>,
    /// The parameters that do not change the outcome.
    pub ignore: Option<Vec<syn::Ident>>,
    /// A readable label for the claim, shown by an operator's listing.
    pub label: Option<Expr>,
    /// The lookup that asks the effect's destination, before the body, whether an attempt
    /// that died mid-body had its effect.
    pub reconcile: Option<Expr>,
    pub krate: Option<Path>,
    /// Errors found while parsing; reported together, all at once.
    pub errors: Option<syn::Error>,
}

/// A `ttl` or `lease` value.
pub(crate) enum Duration {
    /// A literal such as `"24h"`, checked here, in milliseconds.
    Millis(u64, Span),
    /// Any expression of type `Duration`.
    Expr(Expr),
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum InFlight {
    Wait,
    Reject,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnCancel {
    Release,
    Complete,
}

impl Args {
    fn push_error(&mut self, error: syn::Error) {
        match &mut self.errors {
            Some(errors) => errors.combine(error),
            None => self.errors = Some(error),
        }
    }

    /// Sets an argument once; a second occurrence is an error at its keyword.
    fn set<T>(
        &mut self,
        slot: impl FnOnce(&mut Self) -> &mut Option<T>,
        name: &str,
        span: Span,
        value: T,
    ) {
        let slot = slot(self);
        if slot.is_some() {
            let error = format!("duplicate `{name}` argument of `#[idempotent]`: remove one");
            self.push_error(syn::Error::new(span, error));
        } else {
            *slot = Some(value);
        }
    }
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args {
            key: None,
            store: None,
            ttl: None,
            lease: None,
            namespace: None,
            fingerprint: None,
            in_flight: None,
            wait: None,
            cache_err: None,
            on_cancel: None,
            transaction: None,
            ignore: None,
            label: None,
            reconcile: None,
            krate: None,
            errors: None,
        };
        while !input.is_empty() {
            args.parse_one(input)?;
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        args.check_ttl_against_lease();
        Ok(args)
    }
}

impl Args {
    /// A literal `ttl` shorter than the lease (a literal, or the default): refused here, as
    /// the runtime refuses it for expressions, since a call could outlive its own record's
    /// time and a recorded step expire while its call still runs.
    fn check_ttl_against_lease(&mut self) {
        let Some(Duration::Millis(ttl, span)) = &self.ttl else {
            return;
        };
        let lease = match &self.lease {
            Some(Duration::Millis(lease, _)) => *lease,
            Some(Duration::Expr(_)) => return,
            None => DEFAULT_LEASE_MS,
        };
        if *ttl < lease {
            let (ttl, span) = (*ttl, *span);
            self.push_error(syn::Error::new(
                span,
                format!(
                    "`ttl` ({ttl}ms) must be at least the lease ({lease}ms{}): a result must be kept at least as long as a call may hold its key, or its steps could expire while it runs; raise `ttl` or set a shorter `lease`",
                    if self.lease.is_none() { ", the default" } else { "" }
                ),
            ));
        }
    }

    fn parse_one(&mut self, input: ParseStream<'_>) -> syn::Result<()> {
        let lookahead = input.lookahead1();
        macro_rules! arg {
            ($kw:path, $name:literal, $field:ident, $convert:expr) => {{
                let keyword: $kw = input.parse()?;
                input.parse::<Token![=]>()?;
                let value: Expr = input.parse()?;
                let convert: fn(Expr) -> syn::Result<_> = $convert;
                match convert(value) {
                    Ok(value) => self.set(|a| &mut a.$field, $name, keyword.span, value),
                    Err(error) => self.push_error(error),
                }
                return Ok(());
            }};
        }
        if lookahead.peek(kw::key) {
            arg!(kw::key, "key", key, Ok)
        } else if lookahead.peek(kw::store) {
            arg!(kw::store, "store", store, Ok)
        } else if lookahead.peek(kw::ttl) {
            arg!(kw::ttl, "ttl", ttl, |v| duration(v, "ttl"))
        } else if lookahead.peek(kw::lease) {
            arg!(kw::lease, "lease", lease, |v| duration(v, "lease"))
        } else if lookahead.peek(kw::namespace) {
            arg!(kw::namespace, "namespace", namespace, namespace)
        } else if lookahead.peek(kw::fingerprint) {
            arg!(kw::fingerprint, "fingerprint", fingerprint, Ok)
        } else if lookahead.peek(kw::in_flight) {
            arg!(kw::in_flight, "in_flight", in_flight, |v| choice(
                v,
                "in_flight",
                &[("wait", InFlight::Wait), ("reject", InFlight::Reject)]
            ))
        } else if lookahead.peek(kw::wait) {
            arg!(kw::wait, "wait", wait, |v| duration(v, "wait"))
        } else if lookahead.peek(kw::label) {
            arg!(kw::label, "label", label, Ok)
        } else if lookahead.peek(kw::reconcile) {
            arg!(kw::reconcile, "reconcile", reconcile, Ok)
        } else if lookahead.peek(kw::cache_err) {
            arg!(kw::cache_err, "cache_err", cache_err, Ok)
        } else if lookahead.peek(kw::on_cancel) {
            arg!(kw::on_cancel, "on_cancel", on_cancel, |v| choice(
                v,
                "on_cancel",
                &[
                    ("release", OnCancel::Release),
                    ("complete", OnCancel::Complete)
                ]
            ))
        } else if lookahead.peek(kw::transaction) {
            let keyword: kw::transaction = input.parse()?;
            input.parse::<Token![=]>()?;
            let value: Expr = input.parse()?;
            match parameter(value) {
                Ok(ident) => self.set(
                    |a| &mut a.transaction,
                    "transaction",
                    keyword.span,
                    (ident, keyword.span),
                ),
                Err(error) => self.push_error(error),
            }
            Ok(())
        } else if lookahead.peek(kw::ignore) {
            arg!(kw::ignore, "ignore", ignore, parameters)
        } else if lookahead.peek(Token![crate]) {
            let keyword: Token![crate] = input.parse()?;
            input.parse::<Token![=]>()?;
            let value: Expr = input.parse()?;
            match crate_path(value) {
                Ok(path) => self.set(|a| &mut a.krate, "crate", keyword.span, path),
                Err(error) => self.push_error(error),
            }
            Ok(())
        } else {
            self.unknown(input, lookahead.error())
        }
    }

    /// Reports an unknown argument (with a suggestion when one is close) and skips it, so
    /// that the other arguments are still checked.
    fn unknown(&mut self, input: ParseStream<'_>, expected: syn::Error) -> syn::Result<()> {
        let Ok(name) = input.call(<syn::Ident as syn::ext::IdentExt>::parse_any) else {
            return Err(expected);
        };
        let mut message = format!(
            "unknown argument `{name}` of `#[idempotent]`; expected one of: {}",
            NAMES
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        if let Some(close) = closest(&name.to_string()) {
            message =
                format!("unknown argument `{name}` of `#[idempotent]`: did you mean `{close}`?");
        }
        self.push_error(syn::Error::new(name.span(), message));
        // Skip `= value`, up to the next comma.
        while !input.is_empty() && !input.peek(Token![,]) {
            input.parse::<proc_macro2::TokenTree>()?;
        }
        Ok(())
    }
}

/// The known name closest to `name`, if it is one or two edits away.
fn closest(name: &str) -> Option<&'static str> {
    NAMES
        .iter()
        .map(|known| (edit_distance(name, known), *known))
        .filter(|(distance, _)| *distance <= 2)
        .min()
        .map(|(_, known)| known)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitution = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

fn string_literal(value: &Expr) -> Option<&LitStr> {
    match value {
        Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        }) => Some(lit),
        _ => None,
    }
}

/// The runtime's limits (`idem_runtime::MIN_LEASE`, `MAX_DURATION`), checked here for
/// literals so that they fail at compile time; `tests/calls/limits.rs` keeps the two in step.
const MIN_LEASE_MS: u64 = 100;
const MAX_MS: u64 = 365 * 86_400_000;
/// The runtime's `DEFAULT_LEASE`, for a literal `ttl` without a `lease`.
const DEFAULT_LEASE_MS: u64 = 8_000;

fn duration(value: Expr, name: &str) -> syn::Result<Duration> {
    if let Some(lit) = string_literal(&value) {
        let ms = parse_duration(&lit.value()).map_err(|why| {
            syn::Error::new(
                lit.span(),
                format!(
                    "invalid `{name}` duration {:?}: {why}; write a number and a unit (`ms`, `s`, `m`, `h`, `d`), e.g. `{name} = \"30s\"` or `\"1h30m\"`",
                    lit.value()
                ),
            )
        })?;
        let min = match name {
            "lease" => MIN_LEASE_MS,
            // `"0s"`: a duplicate is refused at once, as `in_flight = "reject"` says.
            "wait" => 0,
            _ => 1,
        };
        if ms < min {
            let why = if name == "lease" {
                "a claim must outlive the round trips that renew it"
            } else {
                "a result that expires at once is never replayed"
            };
            return Err(syn::Error::new(
                lit.span(),
                format!("`{name}` must be at least {min}ms ({why}), e.g. `{name} = \"30s\"`"),
            ));
        }
        if ms > MAX_MS {
            return Err(syn::Error::new(
                lit.span(),
                format!("`{name}` must be at most 365 days (`\"365d\"`), the longest duration stores accept"),
            ));
        }
        return Ok(Duration::Millis(ms, lit.span()));
    }
    if let Expr::Lit(ExprLit {
        lit: Lit::Int(int), ..
    }) = &value
    {
        return Err(syn::Error::new(
            int.span(),
            format!(
                "`{name}` needs a unit: write `{name} = \"{int}s\"`, or a `std::time::Duration`"
            ),
        ));
    }
    Ok(Duration::Expr(value))
}

/// Parses `"500ms"`, `"30s"`, `"1h30m"`, `"7d"` into milliseconds.
fn parse_duration(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("it is empty".into());
    }
    let mut total: u64 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!("expected a number at `{rest}`"));
        }
        let number: u64 = rest[..digits]
            .parse()
            .map_err(|_| "the number is too large".to_string())?;
        rest = rest[digits..].trim_start();
        let unit_len = rest
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        let scale: u64 = match unit {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "" => return Err(format!("`{number}` has no unit")),
            other => return Err(format!("`{other}` is not a unit")),
        };
        total = number
            .checked_mul(scale)
            .and_then(|ms| total.checked_add(ms))
            .ok_or("it is too long")?;
        rest = rest[unit_len..].trim_start();
    }
    if total == 0 {
        return Err("it must be longer than zero".into());
    }
    Ok(total)
}

fn namespace(value: Expr) -> syn::Result<LitStr> {
    match string_literal(&value) {
        Some(lit) if lit.value().trim().is_empty() => Err(syn::Error::new(
            lit.span(),
            "`namespace` must not be empty: name the operation, e.g. `namespace = \"billing.charge.v1\"`",
        )),
        Some(lit) => Ok(lit.clone()),
        None => Err(syn::Error::new(
            value.span(),
            "`namespace` must be a string literal, e.g. `namespace = \"billing.charge.v1\"`: it is part of every key and must not change",
        )),
    }
}

fn choice<T: Copy>(value: Expr, name: &str, options: &[(&str, T)]) -> syn::Result<T> {
    let expected = options
        .iter()
        .map(|(text, _)| format!("`{name} = \"{text}\"`"))
        .collect::<Vec<_>>()
        .join(" or ");
    let Some(lit) = string_literal(&value) else {
        return Err(syn::Error::new(
            value.span(),
            format!("expected {expected}"),
        ));
    };
    let text = lit.value();
    options
        .iter()
        .find(|(option, _)| *option == text)
        .map(|(_, choice)| *choice)
        .ok_or_else(|| {
            syn::Error::new(
                lit.span(),
                format!("invalid `{name}` value {text:?}: expected {expected}"),
            )
        })
}

fn crate_path(value: Expr) -> syn::Result<Path> {
    let Some(lit) = string_literal(&value) else {
        return Err(syn::Error::new(
            value.span(),
            "`crate` must be a string literal path, e.g. `crate = \"my_app::idem\"`",
        ));
    };
    lit.parse::<Path>().map_err(|_| {
        syn::Error::new(
            lit.span(),
            format!(
                "`crate = {:?}` is not a path, e.g. `crate = \"my_app::idem\"`",
                lit.value()
            ),
        )
    })
}

/// The value of `transaction`: the name of a parameter.
fn parameter(value: Expr) -> syn::Result<syn::Ident> {
    match &value {
        Expr::Path(path) if path.qself.is_none() && path.attrs.is_empty() => {
            if let Some(ident) = path.path.get_ident() {
                return Ok(ident.clone());
            }
        }
        _ => {}
    }
    Err(syn::Error::new(
        value.span(),
        "`transaction` names a parameter of the function, e.g. `transaction = tx` with a parameter `tx: &mut sqlx::PgConnection` (or the `SqliteConnection`, `MySqlConnection` of the store's database)",
    ))
}

/// The value of `ignore`: a parameter's name, or a tuple of them.
fn parameters(value: Expr) -> syn::Result<Vec<syn::Ident>> {
    let one = |value: &Expr| match value {
        Expr::Path(path) if path.qself.is_none() && path.attrs.is_empty() => {
            path.path.get_ident().cloned()
        }
        _ => None,
    };
    let names = match &value {
        Expr::Tuple(tuple) => tuple.elems.iter().map(one).collect::<Option<Vec<_>>>(),
        Expr::Paren(paren) => one(&paren.expr).map(|name| vec![name]),
        other => one(other).map(|name| vec![name]),
    };
    names.ok_or_else(|| {
        syn::Error::new(
            value.span(),
            "`ignore` names parameters of the function that do not change the outcome, e.g. `ignore = gateway` or `ignore = (gateway, log)`",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_to_milliseconds() {
        assert_eq!(parse_duration("500ms"), Ok(500));
        assert_eq!(parse_duration("30s"), Ok(30_000));
        assert_eq!(parse_duration("24h"), Ok(86_400_000));
        assert_eq!(parse_duration("1h30m"), Ok(5_400_000));
        assert_eq!(parse_duration("1h 30m"), Ok(5_400_000));
        assert_eq!(parse_duration("7d"), Ok(604_800_000));
    }

    #[test]
    fn bad_durations_say_why() {
        assert_eq!(
            parse_duration("5 parsecs"),
            Err("`parsecs` is not a unit".into())
        );
        assert_eq!(parse_duration("10"), Err("`10` has no unit".into()));
        assert_eq!(parse_duration(""), Err("it is empty".into()));
        assert_eq!(
            parse_duration("0s"),
            Err("it must be longer than zero".into())
        );
        assert_eq!(parse_duration("h"), Err("expected a number at `h`".into()));
        assert!(parse_duration("99999999999999999999d").is_err());
    }

    #[test]
    fn close_names_are_suggested() {
        assert_eq!(closest("tll"), Some("ttl"));
        assert_eq!(closest("keys"), Some("key"));
        assert_eq!(closest("inflight"), Some("in_flight"));
        assert_eq!(closest("timeout"), None);
    }

    /// The reference table (the attribute's rustdoc and the README's): every argument the
    /// parser takes has a row, every row's example parses, and no row names anything else.
    #[test]
    fn the_reference_table_is_the_parser_s() {
        let table = include_str!("reference.md");
        let mut documented = Vec::new();
        for row in table.lines().filter(|l| l.starts_with("| `")) {
            let example = row.split('`').nth(1).expect("a code span opens the row");
            let name = example.split(" = ").next().unwrap();
            let args: Args = syn::parse_str(example)
                .unwrap_or_else(|e| panic!("`{example}` does not parse: {e}"));
            assert!(args.errors.is_none(), "`{example}` is refused");
            let set = match name {
                "key" => args.key.is_some(),
                "store" => args.store.is_some(),
                "ttl" => args.ttl.is_some(),
                "lease" => args.lease.is_some(),
                "namespace" => args.namespace.is_some(),
                "fingerprint" => args.fingerprint.is_some(),
                "in_flight" => args.in_flight.is_some(),
                "wait" => args.wait.is_some(),
                "cache_err" => args.cache_err.is_some(),
                "on_cancel" => args.on_cancel.is_some(),
                "transaction" => args.transaction.is_some(),
                "ignore" => args.ignore.is_some(),
                "label" => args.label.is_some(),
                "reconcile" => args.reconcile.is_some(),
                "crate" => args.krate.is_some(),
                other => panic!("the table documents `{other}`, which the parser does not take"),
            };
            assert!(set, "`{example}` did not set `{name}`");
            documented.push(name);
        }
        assert_eq!(documented, NAMES, "the table's rows, in the parser's order");
    }

    #[test]
    fn arguments_parse_and_errors_accumulate() {
        let args: Args = syn::parse_str(r#"key = a.b, ttl = "1h", in_flight = "reject""#).unwrap();
        assert!(args.key.is_some() && args.errors.is_none());
        assert!(matches!(args.ttl, Some(Duration::Millis(3_600_000, _))));
        assert!(args.in_flight == Some(InFlight::Reject));

        let args: Args = syn::parse_str(r#"key = a, key = b, ttl = "5 parsecs", tll = 1"#).unwrap();
        let errors: Vec<String> = args
            .errors
            .unwrap()
            .into_iter()
            .map(|e| e.to_string())
            .collect();
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(errors[0].contains("duplicate `key`"));
        assert!(errors[1].contains("`parsecs` is not a unit"));
        assert!(errors[2].contains("did you mean `ttl`"));
    }
}
