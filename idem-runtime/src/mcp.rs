//! MCP tools made idempotent, for `rmcp` servers (feature `rmcp`).
//!
//! An agent calls a tool again when it cannot tell whether the first call did its work: a
//! lost response, a restarted session, a checkpoint replayed. Each attempt is a new
//! JSON-RPC request with a new id, so the id cannot be the key; what stays the same is the
//! tool and its arguments. [`Idempotency::guard`] wraps the tools you name in an `rmcp`
//! [`ToolRouter`]: a call is keyed on its tool and its arguments (canonical JSON), or on a
//! key the client put in the request's `_meta` under [`IDEMPOTENCY_KEY`], or on one chosen
//! argument ([`Keyed::argument`]), per principal; the tool's body runs once per key, and
//! every later call with that key gets the recorded [`CallToolResult`] whole.
//!
//! ```
//! use idem_runtime::mcp::{Idempotency, Scoped};
//! use idem_runtime::MemoryStore;
//! use rmcp::handler::server::{router::tool::ToolRouter, wrapper::Parameters};
//! use rmcp::model::{CallToolResult, ContentBlock};
//! use rmcp::{tool, tool_handler, tool_router, ErrorData, ServerHandler};
//!
//! #[derive(serde::Deserialize, schemars::JsonSchema)]
//! struct Charge { order: String, cents: u64 }
//!
//! struct Payments { tools: ToolRouter<Self> }
//!
//! #[tool_router]
//! impl Payments {
//!     #[tool(description = "Charge an order, once")]
//!     async fn charge(&self, Parameters(c): Parameters<Charge>) -> Result<CallToolResult, ErrorData> {
//!         // … the charge, then:
//!         Ok(CallToolResult::success(vec![ContentBlock::text(format!("charged {} for {}", c.cents, c.order))]))
//!     }
//! }
//!
//! #[tool_handler(router = self.tools)]
//! impl ServerHandler for Payments {}
//!
//! # fn main() -> Result<(), idem_runtime::Error> {
//! // Whose keys? Here, the bearer token of the Streamable HTTP request (`.unscoped()` over stdio).
//! let idem = Idempotency::new(MemoryStore::new())
//!     .scope(|request| Some(request.headers.get("authorization")?.to_str().ok()?.to_owned()));
//! let payments = Payments { tools: idem.guard("payments.v1", Payments::tool_router(), ["charge"])? };
//! # let _ = payments; Ok(()) }
//! ```
//!
//! What a call of a guarded tool gets:
//!
//! | call | answer |
//! |---|---|
//! | the first with its key | the tool runs; a result that is not an error is recorded |
//! | a retry (a new request id, the same tool and arguments, or the same `_meta` key and arguments) | the recorded result, content, structured content and `_meta` as they were, with `"rs.idem/replayed": true` in its `_meta`; the tool does not run |
//! | the same `_meta` key (or chosen argument) with other arguments | a tool error (`KEY_REUSED`): a new call needs a new key |
//! | a retry while the first still runs | the first call's result, once it has one, within [`wait`](Idempotency::wait); after that a tool error (`IN_FLIGHT`) that says when to retry |
//! | the tool returns a tool error (`is_error`), a protocol error, or asks for input ([`InputRequiredResult`](rmcp::model::InputRequiredResult)) | that answer; the key is released, so that a retry runs, and the [steps](crate::step) the tool finished are kept: a multi-round-trip call's continuation replays them instead of redoing them |
//! | the client cancels the request (`notifications/cancelled`) | the tool's future is dropped and the key released, as for a dropped future |
//! | a [scope](Idempotency::scope) that cannot name the principal (over stdio, without HTTP) | a tool error (`PRINCIPAL_UNKNOWN`); the tool does not run |
//! | a malformed `_meta` key (not a string of 1 to 255 printable ASCII characters), or a missing chosen argument | a tool error (`KEY_MALFORMED`, `KEY_MISSING`); the tool does not run |
//! | a completed call whose result is gone (evicted) | a tool error (`GONE`): the work was done; the tool does not run again |
//! | the store is down | a tool error (`STORE_UNAVAILABLE`); the tool does not run |
//! | the tool's result could not be recorded (the store failed until the lease ran out) | the tool's own result, with `"rs.idem/unrecorded": true` in its `_meta`: the work ran, and a retry may not get this result |
//!
//! Every tool error of this module's own carries its reason in `_meta` under [`ERROR`]
//! (`{"reason": "KEY_REUSED"}`, and `"retryAfterSeconds"` where a retry is the answer), and
//! a text the model can read; none carries a store's or a library's own text (that goes to
//! `tracing`).
//!
//! **The tool's body** runs as the body of an idempotent call: [`step`](crate::step),
//! [`reconcile`](crate::reconcile) and the key handed to a downstream client
//! ([`attempt`](crate::attempt)) work in it as in an `#[idempotent]` function. A server
//! whose process dies mid-tool leaves the key to lapse at the end of its lease, and the
//! next call that takes it over asks [`reconcile`](crate::reconcile) before it runs the
//! effect again.
//!
//! **A cancellation releases, as a dropped future does**, and rmcp cancels more than
//! `notifications/cancelled`: when a request's transport closes (a Streamable HTTP
//! connection that broke, a stdio client that exited), it gives the handlers still running
//! 5 s to answer, then cancels them too. A tool that can still be mid-effect then, seconds
//! after its client went away, hands its key downstream ([`attempt`](crate::attempt)), so
//! that the destination answers a repeat once, or commits its effect in the store's own
//! transaction: a released key runs its tool again on the next call, without asking.
//!
//! **Guarded tools are marked** with the `idempotentHint` annotation (unless a tool sets it
//! itself), which is now true of them: a repeated call has no further effect.
//!
//! **What the key is.** Two calls are the same call when their principal, tool and key
//! agree: by default the key is the arguments themselves, so that an agent that retries
//! needs to know nothing about idem, and two equal calls within the TTL are one call. A
//! client that means two equal calls to be two puts a key of its own in the request's
//! `_meta` (`{"rs.idem/idempotency-key": "…"}`); the arguments are then its fingerprint.

use std::borrow::Cow;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::{DynCallToolHandler, ToolCallContext};
use rmcp::model::{
    CallToolResponse, CallToolResult, ContentBlock, CreateTaskResult, JsonObject, MetaObject,
    ToolAnnotations,
};
use rmcp::ErrorData;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::http::header::MAX_KEY_LEN;
use crate::http::{ScopeNotChosen, Unscoped};
use crate::{Error, Fingerprint, InFlight, Key, Operation, Outcome, Store};

/// The `_meta` member of a `tools/call` request that carries the client's own key.
pub const IDEMPOTENCY_KEY: &str = "rs.idem/idempotency-key";

/// The `_meta` member of a replayed result, with the value `true`.
pub const REPLAYED: &str = "rs.idem/replayed";

/// The `_meta` member of a tool's result whose record failed, with the value `true`: the
/// tool ran, and a retry may not be answered with this result.
pub const UNRECORDED: &str = "rs.idem/unrecorded";

/// The `_meta` member of a tool error of this module's own: `{"reason": …}`.
pub const ERROR: &str = "rs.idem/error";

/// Who a call is from, for [`Idempotency::scope`].
type ScopeFn = Arc<dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync>;

/// Keys of one principal, named by a function of the HTTP request ([`Idempotency::scope`]).
#[derive(Clone)]
pub struct Scoped(ScopeFn);

impl std::fmt::Debug for Scoped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scoped")
    }
}

/// How a chosen scope names a call's principal.
#[diagnostic::on_unimplemented(
    message = "choose whose keys these are before guarding a tool",
    label = "no scope chosen",
    note = "call `.scope(|request| ..)` (keys per principal) or `.unscoped()` (keys shared by every caller, as over stdio) on `Idempotency::new(store)`"
)]
pub trait McpScope: Clone + Send + Sync + 'static {
    /// The principal of a call, from the HTTP request it came in (none over stdio):
    /// `Some("")` for a server whose keys are shared, `None` when it cannot be named.
    #[doc(hidden)]
    fn principal(&self, request: Option<&http::request::Parts>) -> Option<String>;
}

impl McpScope for Scoped {
    fn principal(&self, request: Option<&http::request::Parts>) -> Option<String> {
        request.and_then(|request| (self.0)(request))
    }
}

impl McpScope for Unscoped {
    fn principal(&self, _: Option<&http::request::Parts>) -> Option<String> {
        Some(String::new())
    }
}

/// A tool to guard, and what its calls are keyed on: its arguments (the default; `"charge"`
/// converts into this), or one of them ([`argument`](Self::argument)); a key in the
/// request's `_meta` comes first either way.
#[derive(Clone, Debug)]
pub struct Keyed {
    tool: Cow<'static, str>,
    argument: Option<Cow<'static, str>>,
}

impl Keyed {
    /// Calls of `tool`, keyed on their arguments.
    pub fn new(tool: impl Into<Cow<'static, str>>) -> Self {
        Self {
            tool: tool.into(),
            argument: None,
        }
    }

    /// Keyed on the argument `name` alone (such as an order id), the other arguments the
    /// call's fingerprint: the same order with another amount is refused (`KEY_REUSED`),
    /// not run again. A call without it is refused (`KEY_MISSING`).
    #[must_use]
    pub fn argument(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.argument = Some(name.into());
        self
    }
}

impl From<&'static str> for Keyed {
    fn from(tool: &'static str) -> Self {
        Self::new(tool)
    }
}

impl From<String> for Keyed {
    fn from(tool: String) -> Self {
        Self::new(tool)
    }
}

/// MCP tools made idempotent in a store; see the [module](self). Cheap to clone.
#[derive(Clone, Debug)]
pub struct Idempotency<St, Sc = ScopeNotChosen> {
    store: St,
    scope: Sc,
    ttl: Duration,
    lease: Duration,
    wait: Duration,
}

impl<St: Store + Clone> Idempotency<St> {
    /// Calls recorded in `store`, for [`DEFAULT_TTL`](crate::DEFAULT_TTL). Choose whose
    /// keys they are with [`scope`](Self::scope) or [`unscoped`](Self::unscoped) before
    /// guarding a tool.
    pub fn new(store: St) -> Self {
        Self {
            store,
            scope: ScopeNotChosen,
            ttl: crate::DEFAULT_TTL,
            lease: crate::DEFAULT_LEASE,
            wait: crate::DEFAULT_WAIT,
        }
    }

    /// Keys are per principal: `principal` names a call's from the HTTP request it came in
    /// (the `http::request::Parts` rmcp's Streamable HTTP server hands the tool), and a call
    /// it cannot name, or one without an HTTP request (stdio), is refused
    /// (`PRINCIPAL_UNKNOWN`). Two principals' equal calls never meet.
    pub fn scope<F>(self, principal: F) -> Idempotency<St, Scoped>
    where
        F: Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.with_scope(Scoped(Arc::new(principal)))
    }

    /// Keys are shared by every caller: for a server with one principal, such as a stdio
    /// server its user started for themselves.
    pub fn unscoped(self) -> Idempotency<St, Unscoped> {
        self.with_scope(Unscoped)
    }
}

impl<St, Sc> Idempotency<St, Sc> {
    fn with_scope<S>(self, scope: S) -> Idempotency<St, S> {
        Idempotency {
            store: self.store,
            scope,
            ttl: self.ttl,
            lease: self.lease,
            wait: self.wait,
        }
    }

    /// How long a result is replayed (default [`DEFAULT_TTL`](crate::DEFAULT_TTL)).
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The claim's lease while a tool runs, renewed as it runs (default
    /// [`DEFAULT_LEASE`](crate::DEFAULT_LEASE)): how long after its server died a call's
    /// key can be taken over.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long a call waits for the same call still running elsewhere before it answers
    /// `IN_FLIGHT` (default [`DEFAULT_WAIT`](crate::DEFAULT_WAIT)); `Duration::ZERO`
    /// answers at once.
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }
}

impl<St: Store + Clone + 'static, Sc> Idempotency<St, Sc> {
    /// `router` with each of `tools` run once per key in `namespace` (a stable name of the
    /// server's tools, such as `"payments.v1"`; the key includes the tool's name), and
    /// marked `idempotentHint`. The other tools are left as they are.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when `router` has no tool of one of the names.
    pub fn guard<S, T>(
        &self,
        namespace: impl Into<Cow<'static, str>>,
        mut router: ToolRouter<S>,
        tools: impl IntoIterator<Item = T>,
    ) -> Result<ToolRouter<S>, Error>
    where
        S: Send + Sync + 'static,
        T: Into<Keyed>,
        Sc: McpScope,
    {
        let operation = Operation::new(namespace)
            .ttl(self.ttl)
            .lease(self.lease)
            .in_flight(InFlight::Wait)
            .wait(self.wait);
        for keyed in tools {
            let keyed = keyed.into();
            let Some(route) = router.map.get_mut(keyed.tool.as_ref()) else {
                return Err(Error::config(format!(
                    "`guard` names the tool `{}`, which the router does not have",
                    keyed.tool
                )));
            };
            let annotations = route
                .attr
                .annotations
                .get_or_insert_with(ToolAnnotations::default);
            annotations.idempotent_hint.get_or_insert(true);
            let guard = Arc::new(Guard {
                store: self.store.clone(),
                scope: self.scope.clone(),
                operation: operation.clone(),
                keyed,
                tool: Arc::clone(&route.call),
            });
            route.call = Arc::new(move |context: ToolCallContext<'_, S>| {
                let guard = Arc::clone(&guard);
                Box::pin(async move { guard.call(context).await })
            });
        }
        Ok(router)
    }
}

/// One guarded tool: its handler, and how its calls are keyed.
struct Guard<St, Sc, S> {
    store: St,
    scope: Sc,
    operation: Operation,
    keyed: Keyed,
    tool: Arc<DynCallToolHandler<S>>,
}

/// What a call of a guarded tool ends in, inside the engine: its answer, not to be
/// recorded (a tool error, a protocol error, a request for input), or idem's error.
enum Failed {
    Passed(Result<CallToolResponse, ErrorData>),
    Idem(Error),
}

impl From<Error> for Failed {
    fn from(err: Error) -> Self {
        Self::Idem(err)
    }
}

/// A tool's answer as it is recorded: a result, or the task it created.
#[derive(Clone, Serialize, Deserialize)]
enum Kept {
    Result(CallToolResult),
    Task(CreateTaskResult),
}

impl<St: Store + Clone, Sc: McpScope, S: Send + Sync + 'static> Guard<St, Sc, S> {
    async fn call(&self, context: ToolCallContext<'_, S>) -> Result<CallToolResponse, ErrorData> {
        let (key, fingerprint) = match self.key(&context) {
            Ok(keyed) => keyed,
            Err(refused) => return Ok(refused.into()),
        };
        let cancelled = context.request_context.ct.clone();
        let tool = Arc::clone(&self.tool);
        // The tool's answer, kept for a call whose record fails: the work ran, so it is
        // answered, marked unrecorded, rather than hidden behind an error.
        let ran = Arc::new(Mutex::new(None));
        let answer = Arc::clone(&ran);
        let body = async move {
            let kept = match tool(context).await {
                Ok(CallToolResponse::Complete(result)) if result.is_error != Some(true) => {
                    Kept::Result(result)
                }
                Ok(CallToolResponse::Task(task)) => Kept::Task(task),
                other => return Err(Failed::Passed(other)),
            };
            *answer.lock().unwrap_or_else(PoisonError::into_inner) = Some(kept.clone());
            Ok(kept)
        };
        let run = self
            .operation
            .run(&self.store, &key, Some(&fingerprint), body);
        // A cancelled request drops the tool's future: its key is released, as for any
        // dropped call. rmcp itself only cancels the token.
        let outcome = tokio::select! {
            outcome = run => outcome,
            () = cancelled.cancelled() => {
                tracing::info!(tool = %self.keyed.tool, "a guarded tool call was cancelled: its key is released");
                return Err(ErrorData::internal_error("the request was cancelled", None));
            }
        };
        match outcome {
            Ok(Outcome::Executed(kept)) => Ok(kept.into_response(None)),
            Ok(Outcome::Replayed(kept)) => Ok(kept.into_response(Some(REPLAYED))),
            Err(Failed::Passed(answer)) => answer,
            Err(Failed::Idem(err @ Error::Unrecorded(_))) => {
                let kept = ran.lock().unwrap_or_else(PoisonError::into_inner).take();
                tracing::warn!(error = %err, tool = %self.keyed.tool, "a guarded tool's result was not recorded: answered, marked unrecorded");
                Ok(kept.map_or_else(
                    || tool_error(&err).into(),
                    |kept| kept.into_response(Some(UNRECORDED)),
                ))
            }
            Err(Failed::Idem(err)) => Ok(tool_error(&err).into()),
        }
    }

    /// The call's key and fingerprint, or the tool error that refuses it.
    fn key(&self, context: &ToolCallContext<'_, S>) -> Result<(Key, Fingerprint), CallToolResult> {
        let parts = context
            .request_context
            .extensions
            .get::<http::request::Parts>();
        let Some(principal) = self.scope.principal(parts) else {
            tracing::info!(tool = %self.keyed.tool, "a guarded tool call whose principal is unknown: refused");
            return Err(refusal(
                "PRINCIPAL_UNKNOWN",
                "This tool runs once per call, but whose call this is cannot be told: authenticate, and call it again.",
            ));
        };
        let arguments = canonical(context.arguments.as_ref()).map_err(|err| tool_error(&err))?;
        let fingerprint = {
            let mut digest = Sha256::new();
            digest.update(self.keyed.tool.as_bytes());
            digest.update([0]);
            digest.update(arguments.as_bytes());
            Fingerprint::from_bytes(digest.finalize().into())
        };
        let chosen;
        let (source, value) = match context.request_context.meta.get(IDEMPOTENCY_KEY) {
            Some(Value::String(key)) if well_formed(key) => ("meta", key.as_str()),
            Some(_) => {
                return Err(refusal(
                    "KEY_MALFORMED",
                    "The request's `_meta` idempotency key must be a string of 1 to 255 printable ASCII characters.",
                ))
            }
            None => match &self.keyed.argument {
                None => ("arguments", arguments.as_str()),
                Some(name) => {
                    let found = context.arguments.as_ref().and_then(|a| a.get(name.as_ref()));
                    let Some(found) = found.filter(|v| !v.is_null()) else {
                        return Err(refusal(
                            "KEY_MISSING",
                            &format!("This tool needs the argument `{name}`: it says which call this is."),
                        ));
                    };
                    chosen = canonical_of(found).map_err(|err| tool_error(&err))?;
                    ("argument", chosen.as_str())
                }
            },
        };
        let key = self
            .operation
            .key(&(principal.as_str(), self.keyed.tool.as_ref(), source, value))
            .map_err(|err| tool_error(&err))?;
        Ok((key, fingerprint))
    }
}

impl Kept {
    /// The answer, its `_meta` marked `marker: true` if there is one.
    fn into_response(self, marker: Option<&str>) -> CallToolResponse {
        let mark = |meta: &mut Option<MetaObject>| {
            if let Some(marker) = marker {
                meta.get_or_insert_with(MetaObject::new)
                    .insert(marker.to_owned(), Value::Bool(true));
            }
        };
        match self {
            Self::Result(mut result) => {
                mark(&mut result.meta);
                CallToolResponse::Complete(result)
            }
            Self::Task(mut task) => {
                mark(&mut task.meta);
                CallToolResponse::Task(task)
            }
        }
    }
}

/// A client's `_meta` key: 1 to 255 printable ASCII characters, as an `Idempotency-Key`.
fn well_formed(key: &str) -> bool {
    !key.is_empty() && key.len() <= MAX_KEY_LEN && key.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// The arguments as canonical JSON (members sorted, numbers by their exact value), so that
/// the same arguments in another order, or `1.0` for `1`, are the same call.
fn canonical(arguments: Option<&JsonObject>) -> Result<String, Error> {
    match arguments {
        Some(arguments) => canonical_of(arguments),
        None => Ok("{}".to_owned()),
    }
}

/// `value` in the canonical form; where that form cannot be written (a document nested
/// deeper than it reads), `value` as serde_json writes it: never one text for two values.
fn canonical_of<V: Serialize + ?Sized>(value: &V) -> Result<String, Error> {
    let written = serde_json::to_string(value).map_err(Error::codec)?;
    let canonical = crate::http::fingerprint::canonical_json(written.as_bytes())
        .and_then(|bytes| String::from_utf8(bytes).ok());
    Ok(canonical.unwrap_or(written))
}

/// A tool error of this module's own: `text` for the model, the reason in `_meta`.
fn refusal(reason: &str, text: &str) -> CallToolResult {
    refusal_with(reason, text, None)
}

fn refusal_with(reason: &str, text: &str, retry_after: Option<Duration>) -> CallToolResult {
    let mut result = CallToolResult::error(vec![ContentBlock::text(text)]);
    let mut error = serde_json::Map::new();
    error.insert("reason".to_owned(), Value::from(reason));
    if let Some(after) = retry_after {
        error.insert(
            "retryAfterSeconds".to_owned(),
            Value::from(after.as_secs().max(1)),
        );
    }
    let mut meta = MetaObject::new();
    meta.insert(ERROR.to_owned(), Value::Object(error));
    result.meta = Some(meta);
    result
}

/// The tool error an [`Error`] is answered with (see the [module](self)'s table). Its text
/// never carries the error's own.
pub fn tool_error(err: &Error) -> CallToolResult {
    match err {
        Error::InProgress => {
            let after = err.retry_after().unwrap_or(crate::RETRY_AFTER);
            refusal_with(
                "IN_FLIGHT",
                &format!(
                    "The same call is still running. Call it again in {} s, with the same arguments, to get its result.",
                    after.as_secs().max(1)
                ),
                Some(after),
            )
        }
        Error::PayloadMismatch => refusal(
            "KEY_REUSED",
            "This idempotency key was already used with other arguments. A new call needs a new key.",
        ),
        Error::Gone => refusal(
            "GONE",
            "This call was completed earlier, and its result is no longer kept. It is not run again.",
        ),
        Error::Store(_) => {
            tracing::warn!(error = %err, "the idempotency store failed: the tool call is refused");
            refusal_with(
                "STORE_UNAVAILABLE",
                "The call was not run. Call it again, with the same arguments, in a moment.",
                Some(crate::RETRY_AFTER),
            )
        }
        Error::Unrecorded(_) => {
            tracing::warn!(error = %err, "a guarded tool's result was not recorded");
            refusal(
                "UNRECORDED",
                "The call ran, but its result could not be kept. Check its effect before calling it again.",
            )
        }
        other => {
            tracing::error!(error = %other, "a guarded tool call failed inside idem");
            refusal("INTERNAL", "The call could not be keyed or recorded.")
        }
    }
}

impl From<Error> for CallToolResult {
    fn from(err: Error) -> Self {
        tool_error(&err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_is_its_documented_tool_error() {
        let cases = [
            (Error::InProgress, "IN_FLIGHT", true),
            (Error::PayloadMismatch, "KEY_REUSED", false),
            (Error::Gone, "GONE", false),
            (
                Error::store("db at 10.0.0.3 down"),
                "STORE_UNAVAILABLE",
                true,
            ),
            (Error::Unrecorded("disk full".into()), "UNRECORDED", false),
            (Error::codec("bad json at byte 3"), "INTERNAL", false),
        ];
        for (err, reason, retry_after) in cases {
            let result = tool_error(&err);
            assert_eq!(result.is_error, Some(true), "{err:?}");
            let error = &result.meta.as_ref().expect("a _meta")[ERROR];
            assert_eq!(error["reason"], reason, "{err:?}");
            assert_eq!(
                error.get("retryAfterSeconds").is_some(),
                retry_after,
                "{err:?}"
            );
            let text = serde_json::to_string(&result.content).unwrap();
            assert!(
                !text.contains("10.0.0.3") && !text.contains("disk") && !text.contains("byte 3"),
                "a tool error carries no internal text: {text}"
            );
        }
    }

    fn canonical_ok(arguments: Option<&JsonObject>) -> String {
        canonical(arguments).unwrap()
    }

    #[test]
    fn equal_arguments_in_any_order_and_notation_are_one_key() {
        let object = |value: Value| value.as_object().cloned();
        let a = canonical_ok(
            object(
                serde_json::json!({"order": "o-1", "cents": 500, "tags": {"b": 1, "a": [1.0, 2]}}),
            )
            .as_ref(),
        );
        let b = canonical_ok(object(serde_json::json!({"tags": {"a": [1, 2e0], "b": 1.0}, "cents": 5e2, "order": "o-1"})).as_ref());
        assert_eq!(a, b);
        let c = canonical_ok(object(serde_json::json!({"order": "o-1", "cents": 501})).as_ref());
        assert_ne!(a, c);
        assert_eq!(
            canonical_ok(None),
            canonical_ok(object(serde_json::json!({})).as_ref())
        );
        // Deeper than the canonical form reads: serde_json's own text, one per value.
        let deep = |leaf: u64| {
            let mut value = serde_json::json!(leaf);
            for _ in 0..200 {
                value = serde_json::json!([value]);
            }
            value
        };
        assert_ne!(
            canonical_of(&deep(1)).unwrap(),
            canonical_of(&deep(2)).unwrap()
        );
        assert!(well_formed("k-1") && well_formed(&"k".repeat(MAX_KEY_LEN)));
        assert!(
            !well_formed("") && !well_formed("é") && !well_formed(&"k".repeat(MAX_KEY_LEN + 1))
        );
    }
}
