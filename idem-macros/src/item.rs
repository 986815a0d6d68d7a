//! Checking the annotated function: its shape, and what the key expression may name.

use std::collections::BTreeSet;

use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::{Expr, FnArg, ItemFn, Pat, ReceiverKind, ReturnType, Type};

use crate::attr::{Args, OnCancel};

/// Collects every error in the function's shape; `Ok` when it can be expanded.
pub(crate) fn check(item: &ItemFn, args: &Args) -> syn::Result<()> {
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

    if let ReturnType::Default = sig.output {
        errors.push(syn::Error::new(
            sig.paren_token.span.close(),
            "`#[idempotent]` functions must return `Result<T, E>`: add a return type, e.g. `-> Result<Receipt, PayError>`",
        ));
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
                    "`transaction = {tx}` names no parameter of `{}`: add a parameter `{tx}: &mut sqlx::PgConnection` (callers pass `&mut transaction`)",
                    sig.ident
                ),
            ));
        }
        if args.store.is_none() {
            errors.push(syn::Error::new(
                *keyword,
                "`transaction` needs `store = …`, a `PostgresStore`: the key is claimed in that store's table, inside the caller's transaction",
            ));
        }
        if args.on_cancel == Some(OnCancel::Complete) {
            errors.push(syn::Error::new(
                *keyword,
                "`transaction` cannot go with `on_cancel = \"complete\"`: the body runs on the caller's connection, which cannot be moved to a background task; remove `on_cancel` (a cancelled call leaves the transaction to the caller)",
            ));
        }
    } else if args.on_cancel == Some(OnCancel::Complete) {
        errors.extend(borrowed_inputs(item));
    }

    errors
        .into_iter()
        .reduce(|mut all, e| {
            all.combine(e);
            all
        })
        .map_or(Ok(()), Err)
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

    fn visit_expr_closure(&mut self, closure: &syn::ExprClosure) {
        self.patterns.extend(closure.inputs.iter().cloned());
        self.visit_expr(&closure.body);
    }
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
        match check(&item, &args) {
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
            "key = req.id",
            "async fn f(order: &Order, gw: &Gw) -> Result<(), E> { Ok(()) }",
        );
        assert_eq!(e.len(), 1);
        assert!(e[0].contains("`req` is not a parameter of `f`"), "{e:?}");
        assert!(e[0].contains("`gw`, `order`"), "{e:?}");
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
            "key = x, on_cancel = \"complete\"",
            "async fn f(x: u8, y: &str, z: Cow<'a, str>, w: Arc<T>, s: &'static str) -> Result<(), E> { Ok(()) }",
        );
        assert_eq!(e.len(), 2, "{e:?}");
    }
}
