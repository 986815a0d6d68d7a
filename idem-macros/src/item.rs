//! Checking the annotated function: its shape, and what the key expression may name.

use std::collections::BTreeSet;

use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::{Expr, FnArg, ItemFn, Pat, ReceiverKind, ReturnType, Type};

use crate::attr::{Args, Duration, OnCancel};

/// Collects every error in the function's shape; `Ok` when it can be expanded. `parsed`:
/// the arguments parsed without errors (only then are parameters checked for being
/// accounted for, so that one mistake makes one error).
pub(crate) fn check(item: &ItemFn, args: &Args, parsed: bool) -> syn::Result<()> {
    let mut errors: Vec<syn::Error> = Vec::new();
    let sig = &item.sig;

    if let Some(constness) = &sig.constness {
        errors.push(syn::Error::new(
            constness.span,
            "`#[idempotent]` cannot make a `const fn` idempotent: remove `const` and write an `async fn`",
        ));
    } else if sig.asyncness.is_none() {
        errors.push(syn::Error::new(
            sig.fn_token.span,
            "`#[idempotent]` needs an `async fn`: write `async fn` (the call claims a key in a store, which is asynchronous)",
        ));
    }

    match &sig.output {
        ReturnType::Default => errors.push(syn::Error::new(
            sig.paren_token.span.close(),
            "`#[idempotent]` functions must return `Result<T, E>`: add a return type, e.g. `-> Result<Receipt, PayError>`",
        )),
        ReturnType::Type(_, ty) => {
            if let Some(nested) = ok_type(ty).and_then(nested_option) {
                errors.push(syn::Error::new(
                    nested.span(),
                    "`#[idempotent]` cannot replay `Option<Option<_>>` as itself: JSON records `Some(None)` and `None` alike (`null`), so a replay of `Some(None)` would be `None`; return a type that tells them apart, e.g. `enum Lookup<T> { Missing, Found(Option<T>) }` or a struct around the inner `Option`",
                ));
            }
        }
    }

    let receiver = sig.receiver();
    if let (Some(receiver), None) = (receiver, &args.namespace) {
        errors.push(syn::Error::new(
            receiver.self_token.span,
            "`#[idempotent]` on a method needs an explicit `namespace`, e.g. `namespace = \"orders.create.v1\"`: \
             the attribute cannot see the `impl` type, so same-named methods of two types in one module would share keys",
        ));
    }

    let params = parameters(item);
    for (role, expr) in [("key", &args.key), ("fingerprint", &args.fingerprint)] {
        if let Some(expr) = expr {
            errors.extend(unknown_names(expr, role, &params, &sig.ident));
        }
    }

    if let Some((tx, keyword)) = &args.transaction {
        if !params.contains(&tx.to_string()) {
            errors.push(syn::Error::new(
                tx.span(),
                format!(
                    "`transaction = {tx}` names no parameter of `{}`: add a parameter `{tx}: &mut sqlx::PgConnection` (`SqliteConnection`, `MySqlConnection`: the store's database's; callers pass `&mut transaction`)",
                    sig.ident
                ),
            ));
        }
        if args.store.is_none() {
            errors.push(syn::Error::new(
                *keyword,
                "`transaction` needs `store = …`, a `PostgresStore`, `SqliteStore` or `MySqlStore`: the key is claimed in that store's table, inside the caller's transaction",
            ));
        }
        if args.on_cancel == Some(OnCancel::Complete) {
            errors.push(syn::Error::new(
                *keyword,
                "`transaction` cannot go with `on_cancel = \"complete\"`: the body runs on the caller's connection, which cannot be moved to a background task; remove `on_cancel` (a cancelled call leaves the transaction to the caller)",
            ));
        }
        if let Some(reconcile) = &args.reconcile {
            errors.push(syn::Error::new(
                reconcile.span(),
                "`reconcile` has nothing to ask with `transaction`: the claim, the effect and the record commit together, so no claim is ever left in doubt; remove `reconcile` (it is for a store outside the effect's database)",
            ));
        }
    } else if args.on_cancel == Some(OnCancel::Complete) {
        errors.extend(borrowed_inputs(item));
    }

    // Checked once the rest is right: an unknown name in the key, or a misnamed
    // `transaction`, would otherwise also leave the parameter it meant unaccounted.
    if parsed && errors.is_empty() && args.key.is_some() {
        errors.extend(unaccounted(item, args, &params));
    }

    errors
        .into_iter()
        .reduce(|mut all, e| {
            all.combine(e);
            all
        })
        .map_or(Ok(()), Err)
}

/// The `T` of a return type written `Result<T, E>` (any path ending in `Result`).
fn ok_type(ty: &Type) -> Option<&Type> {
    first_argument(ty, "Result")
}

/// Whether a return type is written as a `Result`: a path whose last segment is `Result` or
/// ends with it (an alias such as `PayResult<T>` or `io::Result<T>`). Only those get the
/// `name_outcome` sibling; any other type is refused with its own error.
pub(crate) fn names_a_result(ty: &Type) -> bool {
    let Type::Path(path) = ty else {
        return false;
    };
    path.path
        .segments
        .last()
        .is_some_and(|last| last.ident.to_string().ends_with("Result"))
}

/// `T` and `E` of a return type written `Result<T, E>` (any path ending in `Result`, with
/// two type arguments).
pub(crate) fn result_arguments(ty: &Type) -> Option<(&Type, &Type)> {
    let Type::Path(path) = ty else {
        return None;
    };
    let last = path
        .path
        .segments
        .last()
        .filter(|last| last.ident == "Result")?;
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    let mut types = args.args.iter().filter_map(|arg| match arg {
        syn::GenericArgument::Type(ty) => Some(ty),
        _ => None,
    });
    match (types.next(), types.next(), types.next()) {
        (Some(ok), Some(err), None) => Some((ok, err)),
        _ => None,
    }
}

/// The inner `Option` of `Option<Option<_>>`, as written.
fn nested_option(ty: &Type) -> Option<&Type> {
    first_argument(ty, "Option").filter(|inner| first_argument(inner, "Option").is_some())
}

/// The first type argument of `ty` when it is a path ending in `name<…>`.
fn first_argument<'t>(ty: &'t Type, name: &str) -> Option<&'t Type> {
    let Type::Path(path) = ty else {
        return None;
    };
    let last = path
        .path
        .segments
        .last()
        .filter(|last| last.ident == name)?;
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    args.args.iter().find_map(|arg| match arg {
        syn::GenericArgument::Type(ty) => Some(ty),
        _ => None,
    })
}

/// The names the parameters bind, and `self`.
fn parameters(item: &ItemFn) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for input in &item.sig.inputs {
        match input {
            FnArg::Receiver(_) => {
                names.insert("self".to_string());
            }
            FnArg::Typed(typed) => Bindings(&mut names).visit_pat(&typed.pat),
        }
    }
    names
}

/// Collects the identifiers a pattern binds.
struct Bindings<'a>(&'a mut BTreeSet<String>);

impl Visit<'_> for Bindings<'_> {
    fn visit_pat_ident(&mut self, pat: &syn::PatIdent) {
        self.0.insert(pat.ident.to_string());
        syn::visit::visit_pat_ident(self, pat);
    }
}

/// Errors for lowercase single-name paths in `expr` that are neither parameters nor bound
/// inside the expression itself (closure parameters, `let`, `match` arms): such a name is a
/// local of the function body, which does not exist yet when the key is derived, or a typo.
fn unknown_names(
    expr: &Expr,
    role: &str,
    params: &BTreeSet<String>,
    function: &syn::Ident,
) -> Vec<syn::Error> {
    let mut bound = params.clone();
    let mut finder = Names::default();
    finder.visit_expr(expr);
    for pat in &finder.patterns {
        Bindings(&mut bound).visit_pat(pat);
    }
    let listed = if params.is_empty() {
        "it has none".to_string()
    } else {
        params
            .iter()
            .map(|p| format!("`{p}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    finder
        .uses
        .into_iter()
        .filter(|ident| !bound.contains(&ident.to_string()))
        .map(|ident| {
            syn::Error::new(
                ident.span(),
                format!(
                    "`{ident}` is not a parameter of `{function}`: the `{role}` is derived from the parameters before the body runs; use one of: {listed}"
                ),
            )
        })
        .collect()
}

#[derive(Default)]
struct Names {
    uses: Vec<syn::Ident>,
    patterns: Vec<Pat>,
    /// Identifiers inside macro calls (`format!("{}", order.id)`): syn cannot parse their
    /// arguments as expressions, so they count as mentioned, never as unknown.
    in_macros: BTreeSet<String>,
}

/// Every identifier in `tokens`, nested groups included.
fn idents(tokens: proc_macro2::TokenStream, into: &mut BTreeSet<String>) {
    for token in tokens {
        match token {
            proc_macro2::TokenTree::Ident(ident) => {
                into.insert(ident.to_string());
            }
            proc_macro2::TokenTree::Group(group) => idents(group.stream(), into),
            // `format!("{order_id}")`: names captured by a format string.
            proc_macro2::TokenTree::Literal(literal) => {
                let text = literal.to_string();
                for piece in text.split('{').skip(1) {
                    let name: String = piece
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() {
                        into.insert(name);
                    }
                }
            }
            _ => {}
        }
    }
}

impl Visit<'_> for Names {
    fn visit_expr_path(&mut self, path: &syn::ExprPath) {
        let is_local = path.qself.is_none()
            && path.path.leading_colon.is_none()
            && path.path.segments.len() == 1
            && path.path.segments[0].arguments.is_none();
        if is_local {
            let ident = &path.path.segments[0].ident;
            // Constants, statics and unit structs are capitalised; `self` is a parameter.
            if ident
                .to_string()
                .starts_with(|c: char| c.is_lowercase() || c == '_')
            {
                self.uses.push(ident.clone());
            }
        }
        syn::visit::visit_expr_path(self, path);
    }

    fn visit_expr_call(&mut self, call: &syn::ExprCall) {
        // `make_key(order)`: the callee is a function, not a local.
        if !matches!(&*call.func, Expr::Path(_)) {
            self.visit_expr(&call.func);
        }
        for arg in &call.args {
            self.visit_expr(arg);
        }
    }

    fn visit_pat(&mut self, pat: &Pat) {
        self.patterns.push(pat.clone());
    }

    fn visit_macro(&mut self, mac: &syn::Macro) {
        idents(mac.tokens.clone(), &mut self.in_macros);
    }

    fn visit_expr_closure(&mut self, closure: &syn::ExprClosure) {
        self.patterns.extend(closure.inputs.iter().cloned());
        self.visit_expr(&closure.body);
    }
}

/// Every parameter (receivers aside) must be named by `key`, `fingerprint`, `store`,
/// `transaction`, `ttl`, `lease` or `ignore`: one that is not could differ between a call
/// and its retry without the retry noticing, which would replay a result made from another
/// value. (One also in `ignore` after `ttl` or `lease` is no error: `ignore` was once the
/// only way to account for it.)
fn unaccounted(item: &ItemFn, args: &Args, params: &BTreeSet<String>) -> Vec<syn::Error> {
    let mut errors = Vec::new();
    let function = &item.sig.ident;
    let names = |expr: &Option<Expr>| expr.as_ref().map(mentioned).unwrap_or_default();
    let (in_key, in_fingerprint, in_store) = (
        names(&args.key),
        names(&args.fingerprint),
        names(&args.store),
    );
    let transaction = args.transaction.as_ref().map(|(tx, _)| tx.to_string());
    // A parameter the attribute itself uses (`ttl = ttl`, `lease = policy.lease`) changes
    // how long the result is kept or the claim lives, never the result: accounted for.
    let durations = |duration: &Option<Duration>| match duration {
        Some(Duration::Expr(expr)) => mentioned(expr),
        _ => BTreeSet::new(),
    };
    let mut in_settings = durations(&args.ttl);
    in_settings.extend(durations(&args.lease));

    let mut ignored = BTreeSet::new();
    for name in args.ignore.iter().flatten() {
        let text = name.to_string();
        let clash = if in_key.contains(&text) {
            Some("`key`: a parameter of the key changes the outcome")
        } else if in_fingerprint.contains(&text) {
            Some("`fingerprint`: a parameter of the fingerprint changes the outcome")
        } else if in_store.contains(&text) {
            Some("`store`: it is accounted for there")
        } else if transaction.as_deref() == Some(text.as_str()) {
            Some("`transaction`: it is accounted for there")
        } else {
            None
        };
        if !params.contains(&text) || text == "self" {
            errors.push(syn::Error::new(
                name.span(),
                format!(
                    "`{name}` is not a parameter of `{function}`: `ignore` names parameters that do not change the outcome, e.g. `ignore = gateway`"
                ),
            ));
        } else if let Some(clash) = clash {
            errors.push(syn::Error::new(
                name.span(),
                format!("`{name}` is in `ignore` and in {clash}; remove it from `ignore`"),
            ));
        } else if !ignored.insert(text) {
            errors.push(syn::Error::new(
                name.span(),
                format!("`{name}` is in `ignore` twice: remove one"),
            ));
        }
    }

    let stores = store_generics(&item.sig.generics);
    for input in &item.sig.inputs {
        let FnArg::Typed(typed) = input else { continue };
        let mut bound = Vec::new();
        BindingIdents(&mut bound).visit_pat(&typed.pat);
        for ident in bound {
            let name = ident.to_string();
            let accounted = in_key.contains(&name)
                || in_fingerprint.contains(&name)
                || in_store.contains(&name)
                || transaction.as_deref() == Some(name.as_str())
                || in_settings.contains(&name)
                || ignored.contains(&name);
            if accounted {
                continue;
            }
            let message = if args.store.is_none() && is_store(&typed.ty, &stores) {
                format!(
                    "`{name}` is a store, but `store =` does not name it: without `store = …` the call claims its key in the process-wide default, an in-memory store, so its records die with the process and no other instance sees them; name it: `store = {name}` (or `ignore = {name}` if this call's claims belong in the default)"
                )
            } else {
                format!(
                    "`{name}` is not in `key`, `fingerprint` or `ignore`: a retry with the same key and another `{name}` would replay the result made with the first `{name}`; \
                     add it to `fingerprint = …` to refuse such a retry (`PayloadMismatch`), to `key = …` if another `{name}` is another operation, \
                     or to `ignore = {name}` if it does not change the outcome (a client, a logger, a clock)"
                )
            };
            errors.push(syn::Error::new(ident.span(), message));
        }
    }
    errors
}

/// The names an argument's expression mentions: its paths, and any identifier inside a
/// macro call (whose arguments syn cannot parse as expressions).
fn mentioned(expr: &Expr) -> BTreeSet<String> {
    let mut names = Names::default();
    names.visit_expr(expr);
    let mut mentioned: BTreeSet<String> = names.uses.iter().map(ToString::to_string).collect();
    mentioned.extend(names.in_macros);
    mentioned
}

/// Collects the identifiers a pattern binds, with their spans.
struct BindingIdents<'a>(&'a mut Vec<syn::Ident>);

impl Visit<'_> for BindingIdents<'_> {
    fn visit_pat_ident(&mut self, pat: &syn::PatIdent) {
        self.0.push(pat.ident.clone());
        syn::visit::visit_pat_ident(self, pat);
    }
}

/// The generic type parameters bounded by a trait named `…Store` (`S: Store`,
/// `S: idem_runtime::Store + Clone`, or in a `where` clause).
fn store_generics(generics: &syn::Generics) -> BTreeSet<String> {
    let mut stores = BTreeSet::new();
    let is_store_bound = |bound: &syn::TypeParamBound| {
        matches!(bound, syn::TypeParamBound::Trait(t)
            if t.path.segments.last().is_some_and(|s| s.ident.to_string().ends_with("Store")))
    };
    for param in generics.type_params() {
        if param.bounds.iter().any(is_store_bound) {
            stores.insert(param.ident.to_string());
        }
    }
    if let Some(clause) = &generics.where_clause {
        for predicate in &clause.predicates {
            if let syn::WherePredicate::Type(predicate) = predicate {
                if predicate.bounds.iter().any(is_store_bound) {
                    if let Type::Path(path) = &predicate.bounded_ty {
                        if let Some(ident) = path.path.get_ident() {
                            stores.insert(ident.to_string());
                        }
                    }
                }
            }
        }
    }
    stores
}

/// Whether a parameter's type is a store: it names a type or trait called `…Store`
/// (`&PostgresStore`, `Arc<dyn Store>`, `&impl Store`), or a generic bounded by one.
fn is_store(ty: &Type, generics: &BTreeSet<String>) -> bool {
    struct Finder<'a>(&'a BTreeSet<String>, bool);
    impl Visit<'_> for Finder<'_> {
        fn visit_path_segment(&mut self, segment: &syn::PathSegment) {
            let name = segment.ident.to_string();
            self.1 |= name.ends_with("Store") || self.0.contains(&name);
            syn::visit::visit_path_segment(self, segment);
        }
    }
    let mut finder = Finder(generics, false);
    finder.visit_type(ty);
    finder.1
}

/// `on_cancel = "complete"` runs the body in the background, which cannot borrow.
fn borrowed_inputs(item: &ItemFn) -> Vec<syn::Error> {
    let message = |what: &str| {
        format!(
            "`on_cancel = \"complete\"` runs the body in the background after its caller is gone, so it cannot borrow: \
             {what}; take it by value (e.g. an owned value or an `Arc`), or use `on_cancel = \"release\"`"
        )
    };
    item.sig
        .inputs
        .iter()
        .filter_map(|input| match input {
            FnArg::Receiver(receiver) if borrowed_receiver(receiver) => Some(syn::Error::new(
                receiver.self_token.span,
                message("`self` is a reference"),
            )),
            FnArg::Typed(typed) if borrows(&typed.ty) => {
                let pat = &typed.pat;
                let what = format!("`{}` borrows", quote::quote!(#pat));
                Some(syn::Error::new(typed.ty.span(), message(&what)))
            }
            _ => None,
        })
        .collect()
}

/// `&self`, `&mut self`, or a typed receiver that borrows (`self: &Self`).
fn borrowed_receiver(receiver: &syn::Receiver) -> bool {
    match &receiver.kind {
        ReceiverKind::Reference(..) => true,
        ReceiverKind::Typed(_, ty) => borrows(ty),
        _ => false,
    }
}

fn borrows(ty: &Type) -> bool {
    #[derive(Default)]
    struct Finder(bool);
    impl Visit<'_> for Finder {
        fn visit_type_reference(&mut self, reference: &syn::TypeReference) {
            self.0 |= reference
                .lifetime
                .as_ref()
                .is_none_or(|l| l.ident != "static");
            self.visit_type(&reference.elem);
        }
        fn visit_lifetime(&mut self, lifetime: &syn::Lifetime) {
            self.0 |= lifetime.ident != "static";
        }
    }
    let mut finder = Finder::default();
    finder.visit_type(ty);
    finder.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(args: &str, item: &str) -> Vec<String> {
        let args: Args = syn::parse_str(args).unwrap();
        let item: ItemFn = syn::parse_str(item).unwrap();
        match check(&item, &args, true) {
            Ok(()) => Vec::new(),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn key_may_use_parameters_closures_constants_and_functions() {
        let ok = errors(
            "key = (order.id, CONST, make(order), order.items.iter().map(|i| i.sku).collect::<Vec<_>>())",
            "async fn f(order: &Order) -> Result<(), E> { Ok(()) }",
        );
        assert!(ok.is_empty(), "{ok:?}");
        let ok = errors(
            "key = id, namespace = \"n\"",
            "async fn f(&self, Order { id, .. }: Order) -> Result<(), E> { Ok(()) }",
        );
        assert!(ok.is_empty(), "{ok:?}");
    }

    #[test]
    fn key_naming_a_missing_parameter_is_an_error_listing_the_parameters() {
        let e = errors(
            "key = req.id, ignore = (order, gw)",
            "async fn f(order: &Order, gw: &Gw) -> Result<(), E> { Ok(()) }",
        );
        assert_eq!(e.len(), 1);
        assert!(e[0].contains("`req` is not a parameter of `f`"), "{e:?}");
        assert!(e[0].contains("`gw`, `order`"), "{e:?}");
    }

    #[test]
    fn every_parameter_must_be_accounted_for() {
        let e = errors(
            "key = order_id",
            "async fn f(order_id: u64, amount: u64, gw: &Gw) -> Result<(), E> { Ok(()) }",
        );
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(
            e[0].starts_with("`amount` is not in `key`, `fingerprint` or `ignore`"),
            "{e:?}"
        );
        assert!(e[1].starts_with("`gw` is not in"), "{e:?}");
        // Named through macros (their arguments and a format string's captures), a field,
        // a call, the store, or `ignore`.
        let ok = errors(
            r#"key = format!("{order_id}-{}", region), fingerprint = hash(&req.body), store = ctx.store, ignore = (gw, _log)"#,
            "async fn f(order_id: u64, region: &str, req: &Req, ctx: &Ctx, gw: &Gw, _log: &Log, _: u8) -> Result<(), E> { Ok(()) }",
        );
        assert!(ok.is_empty(), "{ok:?}");
        let e = errors(
            "key = id",
            "async fn f<S: idem_runtime::Store>(id: u64, db: &S) -> Result<(), E> { Ok(()) }",
        );
        assert!(
            e[0].starts_with("`db` is a store, but `store =` does not name it"),
            "{e:?}"
        );
    }

    #[test]
    fn a_parameter_the_attribute_uses_for_ttl_or_lease_is_accounted_for() {
        let ok = errors(
            "key = id, ttl = ttl, lease = policy.lease",
            "async fn f(id: u64, ttl: Duration, policy: &Policy) -> Result<(), E> { Ok(()) }",
        );
        assert!(ok.is_empty(), "{ok:?}");
        // Listed in `ignore` as well, as the rule once asked: still no error.
        let ok = errors(
            "key = id, ttl = ttl, ignore = ttl",
            "async fn f(id: u64, ttl: Duration) -> Result<(), E> { Ok(()) }",
        );
        assert!(ok.is_empty(), "{ok:?}");
        // A literal uses no parameter.
        let e = errors(
            r#"key = id, ttl = "1h""#,
            "async fn f(id: u64, ttl: Duration) -> Result<(), E> { Ok(()) }",
        );
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].starts_with("`ttl` is not in"), "{e:?}");
    }

    #[test]
    fn shape_errors_accumulate() {
        let e = errors("key = x", "fn f(x: u8) {}");
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[0].contains("needs an `async fn`"));
        assert!(e[1].contains("must return `Result<T, E>`"));
    }

    #[test]
    fn methods_need_a_namespace() {
        let e = errors(
            "key = x",
            "async fn f(&self, x: u8) -> Result<(), E> { Ok(()) }",
        );
        assert!(e[0].contains("needs an explicit `namespace`"), "{e:?}");
    }

    #[test]
    fn complete_on_cancel_refuses_borrowed_inputs() {
        let e = errors(
            "key = x, on_cancel = \"complete\", ignore = (y, z, w, s)",
            "async fn f(x: u8, y: &str, z: Cow<'a, str>, w: Arc<T>, s: &'static str) -> Result<(), E> { Ok(()) }",
        );
        assert_eq!(e.len(), 2, "{e:?}");
    }
}
