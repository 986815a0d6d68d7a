//! Generating the idempotent function: a thin call into `idem_runtime::__private`.

use proc_macro2::{Delimiter, Group, Ident, Span, TokenStream, TokenTree};
use quote::{quote, quote_spanned, ToTokens};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{AttrStyle, Expr, ItemFn, ReturnType, Type};

use crate::attr::{Args, Duration, InFlight, OnCancel};
use crate::item;

/// The whole attribute: parse, check, generate. On any error, the user's function is emitted
/// unchanged beside the errors, so that IDEs keep working and no follow-on errors appear.
pub(crate) fn idempotent(attr: TokenStream, input: TokenStream) -> TokenStream {
    let function: ItemFn = match syn::parse2(input.clone()) {
        Ok(function) => function,
        Err(_) => {
            let error = syn::Error::new(
                Span::call_site(),
                "`#[idempotent]` applies to an `async fn` with a body, e.g. `#[idempotent(key = order.id)] async fn charge(order: &Order) -> Result<Receipt, PayError> { … }`",
            );
            return with_errors(error, input);
        }
    };
    let mut args: Args = match syn::parse2(attr) {
        Ok(args) => args,
        Err(error) => return with_errors(error, input),
    };

    let mut errors = args.errors.take();
    let parsed = errors.is_none();
    let mut report = |error: syn::Error| match &mut errors {
        Some(all) => all.combine(error),
        None => errors = Some(error),
    };
    if args.key.is_none() {
        report(syn::Error::new(
            Span::call_site(),
            "missing `key` argument, e.g. `#[idempotent(key = order.id)]` or `#[idempotent(key = (order.id, order.customer_id))]`",
        ));
    }
    if let Err(error) = item::check(&function, &args, parsed) {
        report(error);
    }
    match errors {
        // The function as written, beside the errors: it does not use what the expansion
        // would have (the store, the key's parameters), which must not say so.
        Some(errors) => with_errors(errors, quote!(#[allow(unused_variables)] #input)),
        None => generate(args, function),
    }
}

fn with_errors(errors: syn::Error, input: TokenStream) -> TokenStream {
    let errors = errors.into_compile_error();
    quote!(#errors #input)
}

fn generate(args: Args, function: ItemFn) -> TokenStream {
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
        ..
    } = function;
    // Outer attributes stay on the function; inner ones (`#![allow(..)]` at the top of the
    // body) open the new body, so that they still apply to all of it.
    let (outer, inner): (Vec<_>, Vec<_>) = attrs
        .iter()
        .partition(|attr| matches!(attr.style, AttrStyle::Outer));
    let ReturnType::Type(_, output) = &sig.output else {
        return with_errors(
            syn::Error::new(
                sig.span(),
                "`#[idempotent]` functions must return `Result<T, E>`",
            ),
            quote!(#(#outer)* #vis #sig { #(#inner)* #block }),
        );
    };
    let krate = match &args.krate {
        Some(path) => quote!(#path),
        None => quote!(::idem_runtime),
    };
    let private = quote!(#krate::__private);
    let local = |name: &str| Ident::new(name, Span::mixed_site());
    let (op, key, fingerprint, store) = (
        local("__idem_op"),
        local("__idem_key"),
        local("__idem_fingerprint"),
        local("__idem_store"),
    );

    let namespace = match &args.namespace {
        Some(namespace) => quote!(#namespace),
        None => {
            let name = sig.ident.unraw().to_string();
            quote!(::core::concat!(::core::module_path!(), "::", #name))
        }
    };
    let ttl = args.ttl.as_ref().map(|ttl| {
        let ttl = duration(ttl);
        quote!(.ttl(#ttl))
    });
    let lease = args.lease.as_ref().map(|lease| {
        let lease = duration(lease);
        quote!(.lease(#lease))
    });
    let wait = args.wait.as_ref().map(|wait| {
        let wait = duration(wait);
        quote!(.wait(#wait))
    });
    let in_flight = (args.in_flight == Some(InFlight::Reject))
        .then(|| quote!(.in_flight(#private::InFlight::Reject)));
    let cache_err = args.cache_err.as_ref().map(|is_final| {
        let check = respan(quote!(#private::cache_err), is_final.span());
        let check = quote_spanned!(is_final.span()=> #check(#is_final));
        quote!(.cache_errors(#check))
    });

    // `Result<Option<Key>, Error>`: an `Option` value is an optional key.
    let key_value = args.key.as_ref().map(|value| {
        // `key = &opt` is `key = opt`: the key is taken by reference either way, and an
        // `Option` behind a reference is still an optional key.
        let value = unreferenced(value);
        let derive = respan(quote!(#private::key), value.span());
        let parts = borrowed_parts(value);
        let key = quote_spanned!(value.span()=> #derive(&#op, (&#private::KeyArg(&(#parts))).__idem_key()));
        // At the call site: one of the two traits is always unused, and must not say so.
        quote!({
            use #private::{OptionalKey as _, RequiredKey as _};
            #key
        })
    });
    let fingerprint_value = match &args.fingerprint {
        Some(value) => {
            let parts = borrowed_parts(value);
            let value = quote_spanned!(value.span()=> #private::fingerprint(&(#parts)));
            quote!(::core::option::Option::Some(#value))
        }
        None => quote!(::core::option::Option::None),
    };
    // A call outside a transaction looks for its record in the store first: a record at
    // hand is answered before the call's future exists, and without an owned handle to
    // the store (`look`); a call in a transaction takes the handle at once.
    let looks = args.transaction.is_none();
    let (store_value, store_arg) = match (&args.store, looks) {
        (Some(value), true) => (
            quote_spanned!(value.span()=> {
                use #private::StoreArg as _;
                #private::look(&#op, (#value).__idem_store(), #key, #fingerprint)
            }),
            quote!(#store),
        ),
        (None, true) => (
            quote!(#private::look_default(&#op, #key, #fingerprint)),
            quote!(#store),
        ),
        (Some(value), false) => (
            quote_spanned!(value.span()=> {
                use #private::StoreArg as _;
                #private::owned_store((#value).__idem_store())
            }),
            quote!(&#store),
        ),
        (None, false) => (quote!(#private::default_store()), quote!(#store)),
    };
    // `label = …`, owned before the body takes the arguments; the call is claimed inside
    // `labelled`.
    let label = local("__idem_label");
    let label_value = args.label.as_ref().map(|value| {
        let owned = respan(quote!(#private::label), value.span());
        quote_spanned!(value.span()=> let #label = #owned(#value);)
    });
    let labelled = |call: TokenStream| match &args.label {
        Some(_) => quote_spanned!(output.span()=> #private::labelled(#label, #call)),
        None => call,
    };
    // The return type as the runtime's entry points are given it, every token at the span
    // of its first one, as the entry point's own path: a bound on `T` or `E` that fails is
    // then reported once, at the type, not once for the path and again for the type.
    let returned = respan(output.to_token_stream(), output.span());
    let call = match &args.transaction {
        Some((tx, _)) => {
            // The store must be a transactional one (PostgreSQL's, SQLite's): checked at the
            // store expression's span.
            let store_span = args.store.as_ref().map_or(Span::call_site(), Spanned::span);
            let transactional = respan(quote!(#private::transactional), store_span);
            // The argument too, wrapped in a call whose tokens are at the user's span: the
            // error is then on `store = …`, not the whole attribute, and the local keeps its
            // own hygiene.
            let transactional =
                quote_spanned!(store_span=> #transactional(::core::convert::identity(&#store)));
            // The connection must be the store's database's: checked at `transaction = tx`.
            let tx_store = local("__idem_tx_store");
            let connection_of = respan(quote!(#private::connection_of), tx.span());
            let connection = quote_spanned!(tx.span()=> #connection_of(#tx_store, &mut *#tx));
            let run = respan(quote!(#private::run_in_transaction), output.span());
            // The body becomes a closure of the connection, under the parameter's own name.
            let run = quote_spanned! {output.span()=>
                #run::<_, _, #returned, _>(
                    &#op,
                    #tx_store,
                    #connection,
                    #key,
                    #fingerprint,
                    async move |#tx| #block,
                )
            };
            let run = labelled(run);
            quote_spanned! {output.span()=>
                {
                    let #tx_store = #transactional;
                    #run.await
                }
            }
        }
        None => {
            let body = match &args.reconcile {
                Some(lookup) => reconciled_body(lookup, &block, &returned, &private),
                None => quote!(async move #block),
            };
            // The whole call is spanned at the return type: a type error about `T` or `E`
            // points there.
            let started = if args.on_cancel == Some(OnCancel::Complete) {
                let run = respan(quote!(#private::run_to_completion), output.span());
                quote_spanned! {output.span()=>
                    #run::<_, _, #returned, _>(&#op, #store_arg, #body)
                }
            } else {
                let run = respan(quote!(#private::run), output.span());
                let typing = typing(output, &private);
                quote_spanned! {output.span()=>
                    #run::<_, _, #returned, _, _>(&#op, #store_arg, #body, #typing)
                }
            };
            // Answered at once if the store's look found the record. (Bound first: a
            // temporary in the tail of the body would outlive the operation.)
            let bound = local("__idem_started");
            let later = labelled(quote_spanned!(output.span()=> call));
            quote_spanned! {output.span()=>
                {
                    let #bound = #started;
                    match #bound {
                        #private::Started::Now(answered) => answered,
                        #private::Started::Later(call) => #later.await,
                    }
                }
            }
        }
    };

    // A closure that is never called: it only type-checks that no part of the key or the
    // fingerprint is a `HashSet`, at that part's span.
    let ordered: Vec<TokenStream> = [&args.key, &args.fingerprint]
        .into_iter()
        .flatten()
        .flat_map(parts)
        .map(|part| {
            quote_spanned!(part.span()=> #private::ordered((&#private::KeyPart(&(#part))).__idem_order());)
        })
        .collect();
    let ordered = (!ordered.is_empty()).then(|| {
        quote! {
            let _ = || {
                use #private::{Ordered as _, Unordered as _};
                #(#ordered)*
            };
        }
    });

    let bare = respan(quote!(#private::bare::<#returned>), output.span());
    let result_like = item::names_a_result(output);
    // Not a `Result` as written (nor an alias named `…Result`): no sibling, so that the
    // return type's own error is the only one; the function answers its bare value.
    let answer = if result_like {
        call
    } else {
        quote!(#bare(#call))
    };
    // The sibling names `name`, without calling it: a caller of either keeps both alive, so
    // that `dead_code` speaks only when nothing calls either.
    // (An `impl Trait` argument leaves `name` no path that names all its types: skipped.)
    let keep_alive = (result_like && !has_impl_trait_args(&sig)).then(|| {
        let path = self_path(&sig, &sig.ident);
        quote!(let _ = #path;)
    });
    let statements = quote! {
        #(#inner)*
        #ordered
        #keep_alive
        let #op = #private::Operation::new(#namespace) #ttl #lease #in_flight #wait #cache_err;
        #label_value
        let #key = #key_value;
        let #fingerprint = #fingerprint_value;
        let #store = #store_value;
        #answer
    };
    // The new body keeps the span of the user's braces: the item stays the user's own, so
    // lints such as `dead_code` judge it as written.
    let mut body = Group::new(Delimiter::Brace, statements);
    body.set_span(block.brace_token.span.join());
    if !result_like {
        return quote!(#(#outer)* #vis #sig #body);
    }
    let sibling = outcome_signature(&sig, output, &krate, &private);
    let (thin, call) = thin_call(&sig, &sibling.ident);
    // `name`'s body keeps the span of the user's braces too: `name` is the user's item.
    let mut thin_body = Group::new(Delimiter::Brace, quote!(#bare(#call.await)));
    thin_body.set_span(block.brace_token.span.join());
    quote! {
        #(#outer)*
        #vis #thin #thin_body

        #(#outer)*
        ///
        /// *Generated by `#[idempotent]`:* the same call, answering whether the value was
        /// executed here or replayed (`idem_runtime::Outcome`).
        #vis #sibling #body
    }
}

/// The body with `reconcile = lookup` before it: the lookup is polled only when the call's
/// claim took over an unsettled one, and what it found (a value, or its error) is the
/// function's answer; otherwise the block runs. The lookup is spanned at the user's
/// expression, so that a type error points there.
fn reconciled_body(
    lookup: &Expr,
    block: &syn::Block,
    returned: &TokenStream,
    private: &TokenStream,
) -> TokenStream {
    let found = Ident::new("__idem_reconciled", Span::mixed_site());
    let reconciled = respan(quote!(#private::reconciled), lookup.span());
    let asked = quote_spanned!(lookup.span()=>
        #reconciled::<#returned, _>(async { (#lookup).await }).await
    );
    quote! {
        async move {
            if let ::core::option::Option::Some(#found) = #asked {
                return #found;
            }
            #block
        }
    }
}

/// The signature of `name_outcome`: `name`'s, answering `Result<Outcome<T>, E>`.
fn outcome_signature(
    sig: &syn::Signature,
    output: &Type,
    krate: &TokenStream,
    private: &TokenStream,
) -> syn::Signature {
    let mut sibling = sig.clone();
    sibling.ident = Ident::new(&format!("{}_outcome", sig.ident.unraw()), sig.ident.span());
    let answered = match item::result_arguments(output) {
        // Written as the user wrote it, where it is a `Result<T, E>`: the docs read well.
        Some((ok, err)) => quote!(::core::result::Result<#krate::Outcome<#ok>, #err>),
        // An alias of one (`PayResult<T>`): its parts through the runtime's view of it.
        None => respan(quote!(#private::Answered<#output>), output.span()),
    };
    sibling.output = syn::parse_quote!(-> #answered);
    sibling
}

/// `name`'s own signature (patterns in its parameters named, since it only hands them on)
/// and the call of `sibling` it makes: `self.sibling(…)` on a method, `Self::sibling(…)`
/// where the signature names `Self`, `sibling(…)` otherwise, with the function's type and
/// const parameters spelled out unless an argument is an `impl Trait`.
fn thin_call(sig: &syn::Signature, sibling: &Ident) -> (syn::Signature, TokenStream) {
    let mut thin = sig.clone();
    let mut args = Vec::new();
    let mut receiver = None;
    for (i, input) in thin.inputs.iter_mut().enumerate() {
        // Bindings are only handed on here: no `mut` or `ref` that would go unused.
        match input {
            syn::FnArg::Receiver(own) => {
                if !matches!(own.kind, syn::ReceiverKind::Reference(..)) {
                    own.mutability = None;
                }
                receiver = Some(own.self_token);
            }
            syn::FnArg::Typed(typed) => match &mut *typed.pat {
                syn::Pat::Ident(pat) if pat.subpat.is_none() => {
                    pat.mutability = None;
                    pat.by_ref = None;
                    args.push(pat.ident.clone());
                }
                _ => {
                    let name = Ident::new(&format!("__idem_arg{i}"), Span::mixed_site());
                    *typed.pat = syn::parse_quote!(#name);
                    args.push(name);
                }
            },
        }
    }
    let turbofish = turbofish(sig);
    let call = match receiver {
        Some(self_token) => quote!(#self_token.#sibling #turbofish(#(#args),*)),
        None => {
            let path = self_path(sig, sibling);
            quote!(#path(#(#args),*))
        }
    };
    (thin, call)
}

/// The path to the function `name` of the same place as `sig`'s, with its [`turbofish`]:
/// `Self::name` where the function is an `impl`'s (it has a receiver, or names `Self`),
/// `name` otherwise.
fn self_path(sig: &syn::Signature, name: &Ident) -> TokenStream {
    let turbofish = turbofish(sig);
    if sig.receiver().is_some() || names_self(sig) {
        quote!(Self::#name #turbofish)
    } else {
        quote!(#name #turbofish)
    }
}

/// `sig`'s type and const parameters spelled out, `::<T, N>`; none when it has none, or when
/// an argument is an `impl Trait`, which forbids them.
fn turbofish(sig: &syn::Signature) -> Option<TokenStream> {
    let impl_trait_args = has_impl_trait_args(sig);
    let types: Vec<TokenStream> = sig
        .generics
        .params
        .iter()
        .filter_map(|param| match param {
            syn::GenericParam::Type(ty) => Some(ty.ident.to_token_stream()),
            syn::GenericParam::Const(c) => Some(c.ident.to_token_stream()),
            syn::GenericParam::Lifetime(_) => None,
        })
        .collect();
    (!types.is_empty() && !impl_trait_args).then(|| quote!(::<#(#types),*>))
}

/// Whether an argument of `sig` is an `impl Trait`.
fn has_impl_trait_args(sig: &syn::Signature) -> bool {
    sig.inputs
        .iter()
        .any(|input| matches!(input, syn::FnArg::Typed(typed) if names_impl_trait(&typed.ty)))
}

/// Whether a type holds an `impl Trait`.
fn names_impl_trait(ty: &Type) -> bool {
    contains_ident(ty.to_token_stream(), "impl")
}

/// Whether the signature names `Self` (so the function is an `impl`'s).
fn names_self(sig: &syn::Signature) -> bool {
    contains_ident(sig.to_token_stream(), "Self")
}

fn contains_ident(tokens: TokenStream, name: &str) -> bool {
    tokens.into_iter().any(|token| match token {
        TokenTree::Ident(ident) => ident == name,
        TokenTree::Group(group) => contains_ident(group.stream(), name),
        _ => false,
    })
}

/// The parts of a key or fingerprint value whose type the order check looks at: the
/// elements of tuples and arrays (through parentheses and references), down to places
/// (`order.tags`, `tags`). Calls and other computed values are left out: the check must not
/// evaluate, move or borrow mutably anything the real key expression uses.
fn parts(expr: &Expr) -> Vec<&Expr> {
    match expr {
        Expr::Tuple(tuple) => tuple.elems.iter().flat_map(parts).collect(),
        Expr::Array(array) => array.elems.iter().flat_map(parts).collect(),
        Expr::Paren(paren) => parts(&paren.expr),
        Expr::Group(group) => parts(&group.expr),
        Expr::Reference(reference) if reference.mutability.is_none() => parts(&reference.expr),
        Expr::Path(_) | Expr::Field(_) => vec![expr],
        _ => Vec::new(),
    }
}

/// A tuple with its elements borrowed, `(&order.id, &order.sku)`, down through nested
/// tuples, so that a key or fingerprint of fields that are not `Copy` moves nothing out of
/// the arguments. `&T` serializes as `T` does: the key is the one the tuple of values
/// derives. Anything else as it is written.
fn borrowed_parts(expr: &Expr) -> TokenStream {
    match expr {
        Expr::Tuple(tuple) => {
            let elems = tuple.elems.iter().map(|elem| {
                let elem_parts = borrowed_parts(elem);
                quote_spanned!(elem.span()=> &#elem_parts)
            });
            quote!((#(#elems,)*))
        }
        _ => expr.to_token_stream(),
    }
}

/// The value under any `&` and parentheses.
fn unreferenced(expr: &Expr) -> &Expr {
    match expr {
        Expr::Reference(reference) if reference.mutability.is_none() => {
            unreferenced(&reference.expr)
        }
        Expr::Paren(paren) => unreferenced(&paren.expr),
        _ => expr,
    }
}

/// How a replay from a store in this process may hand back the success value itself: asked
/// of the return type where it is known (a `Clone` type is kept and cloned; any other is
/// decoded). A return type that names a lifetime other than `'static`, or a reference, is
/// always decoded: the probe cannot tell a value that borrows from one that does not, and
/// would fail to compile instead.
fn typing(output: &Type, private: &TokenStream) -> TokenStream {
    if borrows(output.to_token_stream()) {
        return quote!(#private::NoTyping);
    }
    quote!({
        use #private::{TypedByClone as _, TypedByCodec as _};
        (&#private::TypeProbe::<#output>::new()).__idem_typing()
    })
}

/// Whether type tokens hold a reference or a lifetime other than `'static`.
fn borrows(tokens: TokenStream) -> bool {
    let mut tokens = tokens.into_iter().peekable();
    while let Some(token) = tokens.next() {
        match token {
            TokenTree::Punct(punct) if punct.as_char() == '&' => return true,
            TokenTree::Punct(punct)
                if punct.as_char() == '\''
                    && !matches!(tokens.peek(), Some(TokenTree::Ident(name)) if name == "static") =>
            {
                return true;
            }
            TokenTree::Group(group) if borrows(group.stream()) => return true,
            _ => {}
        }
    }
    false
}

/// Sets `span` on every token of a path.
fn respan(path: TokenStream, span: Span) -> TokenStream {
    path.into_iter()
        .map(|mut token| {
            token.set_span(span);
            token
        })
        .collect()
}

fn duration(duration: &Duration) -> TokenStream {
    match duration {
        Duration::Millis(ms, span) => {
            quote_spanned!(*span=> ::core::time::Duration::from_millis(#ms))
        }
        Duration::Expr(expr) => quote!(#expr),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand(attr: &str, item: &str) -> String {
        idempotent(attr.parse().unwrap(), item.parse().unwrap()).to_string()
    }
    /// The guide's page on the expansion (`idem_runtime::guide::expansion`) shows the
    /// expansion of its example exactly: its first code block, token by token.
    #[test]
    fn the_guide_shows_the_expansion() {
        let page = include_str!("../../idem-runtime/guide/expansion.md");
        let shown = page
            .split("```rust,ignore\n")
            .nth(1)
            .and_then(|block| block.split("\n```").next())
            .expect("the section's code block");
        let shown: proc_macro2::TokenStream = shown.parse().expect("the block is Rust tokens");
        let out = expand(
            r#"key = order.id, fingerprint = order.cents, ignore = gateway, ttl = "24h""#,
            "async fn charge(order: &Order, gateway: &Gateway) -> Result<Receipt, PayError> { gateway.charge(order).await }",
        );
        // Layout aside: the spacing of the tokens' text, and the trailing commas rustfmt
        // adds to a call's arguments.
        let plain = |tokens: &str| {
            let text: String = tokens.chars().filter(|c| !c.is_whitespace()).collect();
            text.replace(",)", ")")
        };
        assert_eq!(
            plain(&shown.to_string()),
            plain(&out),
            "the guide's expansion (idem-runtime/guide/expansion.md) is out of date: paste the macro's output there (rustfmt'd)"
        );
    }

    #[test]
    fn generated_code_cannot_panic_and_adds_only_the_function_and_its_sibling() {
        let out = expand(
            r#"key = (order.id, order.customer), fingerprint = order.cents, store = self.store,
               namespace = "billing.charge.v1", cache_err = is_final, ttl = "1h", in_flight = "reject""#,
            "pub async fn charge(&self, order: &Order) -> Result<Receipt, PayError> { Ok(self.go(order).await?) }",
        );
        for forbidden in [
            "unwrap",
            "expect",
            "panic",
            "unreachable",
            "todo",
            "static",
            "const ",
        ] {
            assert!(
                !out.contains(forbidden),
                "`{forbidden}` in the expansion: {out}"
            );
        }
        let file: syn::File = syn::parse_str(&out).expect("the expansion parses as items");
        let names: Vec<String> = file
            .items
            .iter()
            .map(|item| match item {
                syn::Item::Fn(function) => function.sig.ident.to_string(),
                _ => panic!("an item that is no function: {out}"),
            })
            .collect();
        assert_eq!(
            names,
            ["charge", "charge_outcome"],
            "two items, the function and its `_outcome` sibling: {out}"
        );
        let generated: Vec<&str> = out
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|word| word.starts_with("__idem"))
            .collect();
        let known = [
            "__idem_op",
            "__idem_key",
            "__idem_fingerprint",
            "__idem_store",
            "__idem_owned",
            "__idem_order",
            "__idem_key",
            "__idem_typing",
            "__idem_started",
        ];
        assert!(!generated.is_empty());
        assert!(
            generated.iter().all(|name| known.contains(name)),
            "{generated:?}"
        );
    }

    #[test]
    fn every_path_is_absolute() {
        // The user's code names none of the prelude's items, so every one in the output was
        // written by the expansion, and must be reached through a path (`::core::…`).
        let out = expand("key = id", "async fn f(id: u64) -> Res { settle(id) }");
        let tokens: Vec<&str> = out.split_whitespace().collect();
        for (i, token) in tokens.iter().enumerate() {
            if [
                "Ok", "Err", "Some", "None", "Box", "From", "Result", "Option", "Into",
            ]
            .contains(token)
            {
                assert_eq!(
                    tokens[i - 1],
                    "::",
                    "bare `{token}` in the expansion: {out}"
                );
            }
        }
        assert!(out.contains(":: idem_runtime :: __private"), "{out}");
        assert!(out.contains(":: core :: option :: Option :: None"), "{out}");
    }
}
