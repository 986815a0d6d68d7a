//! `idem_runtime::mcp` driven by rmcp's own client, over Streamable HTTP and over a byte
//! stream (the transport of stdio): a retried call replays the recorded result whole; the
//! answers of idem's own are the tool errors the docs give; a duplicate waits for the first;
//! a cancelled call releases its key; a multi-round-trip call's continuation replays the steps
//! its first round did.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::mcp::{Idempotency, Keyed, ERROR, IDEMPOTENCY_KEY, REPLAYED, UNRECORDED};
use idem_runtime::{step, MemoryStore, Store};
use idem_tests::{Down, Probe, DOWN};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::InputResponses;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::ProtocolVersion;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ClientCapabilities, ClientConfig,
    ContentBlock, CreateTaskResult, Implementation, InputRequiredResult, JsonObject,
    RequestMetaObject, Task, TaskStatus,
};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{
    tool, tool_handler, tool_router, ClientLifecycleMode, ClientServiceExt, ErrorData, RoleClient,
    ServerHandler, ServiceExt,
};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{Notify, Semaphore};

#[derive(Deserialize, JsonSchema)]
struct Charge {
    order: String,
    cents: u64,
}

#[derive(Deserialize, JsonSchema)]
struct Ship {
    order: String,
}

/// What the tools did, for the tests to count.
struct Ledger {
    runs: Mutex<HashMap<String, u32>>,
    reservations: AtomicU32,
    /// A `slow` charge says it started here, and waits for a permit of `release`.
    started: Notify,
    release: Semaphore,
    /// Counts the `slow` charges whose future was dropped mid-body.
    dropped: AtomicU32,
}

impl Default for Ledger {
    fn default() -> Self {
        Self {
            runs: Mutex::default(),
            reservations: AtomicU32::new(0),
            started: Notify::new(),
            release: Semaphore::new(0),
            dropped: AtomicU32::new(0),
        }
    }
}

impl Ledger {
    fn run(&self, order: &str) -> u32 {
        let mut runs = self.runs.lock().unwrap();
        let n = runs.entry(order.to_owned()).or_default();
        *n += 1;
        *n
    }

    fn runs(&self, order: &str) -> u32 {
        self.runs.lock().unwrap().get(order).copied().unwrap_or(0)
    }
}

/// Counts a drop before its `done`.
struct DropWatch<'a>(&'a AtomicU32, bool);

impl Drop for DropWatch<'_> {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[derive(Clone)]
struct Shop {
    tools: ToolRouter<Shop>,
    ledger: Arc<Ledger>,
}

#[tool_router]
impl Shop {
    /// Charges an order: `declined` is a tool error, `slow…` waits for the test.
    #[tool(description = "Charge an order")]
    async fn charge(&self, Parameters(c): Parameters<Charge>) -> Result<CallToolResult, ErrorData> {
        if c.order.starts_with("slow") {
            let mut watch = DropWatch(&self.ledger.dropped, false);
            self.ledger.started.notify_one();
            self.ledger.release.acquire().await.unwrap().forget();
            watch.1 = true;
        }
        let run = self.ledger.run(&c.order);
        if c.order == "declined" {
            return Ok(CallToolResult::error(vec![ContentBlock::text(
                "card declined",
            )]));
        }
        let mut result = CallToolResult::structured(json!({
            "order": c.order, "cents": c.cents, "run": run,
        }));
        if c.order == "big" {
            result
                .content
                .push(ContentBlock::text("x".repeat(8 * 1024)));
        }
        result
            .content
            .push(ContentBlock::text(format!("charged {}", c.cents)));
        Ok(result)
    }

    /// Refunds, keyed on the order alone.
    #[tool(description = "Refund an order")]
    async fn refund(&self, Parameters(c): Parameters<Charge>) -> Result<CallToolResult, ErrorData> {
        let run = self.ledger.run(&format!("refund {}", c.order));
        Ok(CallToolResult::structured(
            json!({ "refunded": c.cents, "run": run }),
        ))
    }

    /// Ships after asking the client to confirm: a multi-round-trip call whose first round
    /// reserves stock as a step.
    #[tool(description = "Ship an order once confirmed")]
    async fn ship(
        &self,
        Parameters(s): Parameters<Ship>,
        InputResponses(responses): InputResponses,
    ) -> Result<CallToolResponse, ErrorData> {
        let ledger = &self.ledger;
        let reserved = step("reserve", async {
            let n = ledger.reservations.fetch_add(1, Ordering::SeqCst) + 1;
            Ok::<_, idem_runtime::Error>(format!("hold-{n}"))
        })
        .await
        .map_err(|_| ErrorData::internal_error("reserve", None))?;
        let Some(responses) = responses else {
            return Ok(InputRequiredResult::new(None, Some(format!("confirm {}", s.order))).into());
        };
        let run = ledger.run(&format!("ship {}", s.order));
        Ok(CallToolResult::structured(json!({
            "order": s.order, "hold": reserved, "run": run, "answers": responses.len(),
        }))
        .into())
    }

    /// Starts a task: what the call answers is the task, which a retry must get again.
    #[tool(description = "Start an export")]
    async fn export(&self, Parameters(s): Parameters<Ship>) -> Result<CallToolResponse, ErrorData> {
        let run = self.ledger.run(&format!("export {}", s.order));
        let at = "2026-12-07T00:00:00Z";
        let task = Task::new(
            format!("export-{}-{run}", s.order),
            TaskStatus::Working,
            at,
            at,
        );
        Ok(CreateTaskResult::new(task).into())
    }

    /// Not guarded: runs every time.
    #[tool(description = "Count")]
    async fn count(&self) -> Result<CallToolResult, ErrorData> {
        let run = self.ledger.run("count");
        Ok(CallToolResult::structured(json!({ "run": run })))
    }
}

#[tool_handler(router = self.tools)]
impl ServerHandler for Shop {}

impl Shop {
    /// The shop with its tools guarded by `idem`'s configuration (`wait` for duplicates).
    fn new<St: Store + Clone + 'static>(store: &St, wait: Duration, scoped: bool) -> Self {
        let tools = [
            Keyed::new("charge"),
            Keyed::new("refund").argument("order"),
            Keyed::new("ship"),
            Keyed::new("export"),
        ];
        let idem = Idempotency::new(store.clone()).wait(wait);
        let tools = if scoped {
            idem.scope(|request| {
                Some(
                    request
                        .headers
                        .get("authorization")?
                        .to_str()
                        .ok()?
                        .to_owned(),
                )
            })
            .guard("shop.v1", Shop::tool_router(), tools)
        } else {
            idem.unscoped().guard("shop.v1", Shop::tool_router(), tools)
        };
        Self::with_tools(tools.unwrap())
    }

    fn with_tools(tools: ToolRouter<Shop>) -> Self {
        Self {
            tools,
            ledger: Arc::default(),
        }
    }
}

/// Serves `shop` over Streamable HTTP, stateless, on a port of its own.
async fn serve_http(shop: Shop) -> SocketAddr {
    let config = StreamableHttpServerConfig::default().with_legacy_session_mode(false);
    let service = StreamableHttpService::new(
        move || Ok(shop.clone()),
        Arc::new(NeverSessionManager::default()),
        config,
    );
    let app = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    address
}

/// A client of `address` as `principal` (its bearer token), on connections of its own,
/// speaking MCP 2026-07-28 (`server/discover`, every request self-contained).
async fn http_client(
    address: SocketAddr,
    principal: Option<&str>,
) -> RunningService<RoleClient, ()> {
    let mut config = StreamableHttpClientTransportConfig::with_uri(format!("http://{address}/mcp"));
    if let Some(principal) = principal {
        config = config.auth_header(principal);
    }
    let modern = ClientLifecycleMode::Discover {
        preferred_versions: vec![ProtocolVersion::V_2026_07_28],
    };
    ().serve_with_lifecycle(StreamableHttpClientTransport::from_config(config), modern)
        .await
        .unwrap()
}

/// A client of `shop` over an in-memory byte stream, rmcp's stdio transport without the
/// process: the server has no HTTP request to name a principal by.
async fn stream_client(shop: Shop) -> RunningService<RoleClient, ()> {
    let (client, server) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        let running = shop.serve(server).await.unwrap();
        let _ = running.waiting().await;
    });
    ().serve(client).await.unwrap()
}

fn arguments(value: Value) -> JsonObject {
    value.as_object().unwrap().clone()
}

fn call(tool: &'static str, args: Value, key: Option<&str>) -> CallToolRequestParams {
    let mut params = CallToolRequestParams::new(tool).with_arguments(arguments(args));
    if let Some(key) = key {
        let mut meta = RequestMetaObject::new();
        meta.insert(IDEMPOTENCY_KEY.to_owned(), Value::from(key));
        params.meta = Some(meta);
    }
    params
}

/// Polls `done` until it holds; a minute without it fails the test with `what`.
async fn until(what: &str, done: impl Fn() -> bool) {
    let poll = async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), poll)
        .await
        .unwrap_or_else(|_| panic!("not within a minute: {what}"));
}

fn replayed(result: &CallToolResult) -> bool {
    result.meta.as_ref().and_then(|m| m.get(REPLAYED)) == Some(&Value::Bool(true))
}

fn reason(result: &CallToolResult) -> Option<String> {
    let error = result.meta.as_ref()?.get(ERROR)?;
    Some(error.get("reason")?.as_str()?.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_with_a_new_request_id_replays_the_whole_result() {
    let store = MemoryStore::new();
    let shop = Shop::new(&store, Duration::from_secs(10), true);
    let ledger = shop.ledger.clone();
    let address = serve_http(shop).await;
    let args = json!({ "order": "o-1", "cents": 500 });

    // Two clients, two connections, two request ids: one charge.
    let first = http_client(address, Some("alice")).await;
    let answered = first
        .call_tool(call("charge", args.clone(), None))
        .await
        .unwrap();
    let second = http_client(address, Some("alice")).await;
    let replay = second
        .call_tool(call("charge", args.clone(), None))
        .await
        .unwrap();
    assert_eq!(ledger.runs("o-1"), 1, "a retry does not charge again");
    assert!(!replayed(&answered));
    assert!(replayed(&replay), "the replay is marked: {replay:?}");
    assert_eq!(replay.structured_content, answered.structured_content);
    assert_eq!(replay.content, answered.content);
    assert_eq!(replay.is_error, answered.is_error);

    // The same arguments in another member order, and `500.0` for `500`: the same call.
    let reordered = second
        .call_tool(call(
            "charge",
            json!({ "cents": 500.0, "order": "o-1" }),
            None,
        ))
        .await
        .unwrap();
    assert!(replayed(&reordered));
    assert_eq!(ledger.runs("o-1"), 1);

    // Another principal's equal call is its own.
    let bob = http_client(address, Some("bob")).await;
    let bobs = bob
        .call_tool(call("charge", args.clone(), None))
        .await
        .unwrap();
    assert!(!replayed(&bobs));
    assert_eq!(ledger.runs("o-1"), 2);

    // Other arguments, another call.
    second
        .call_tool(call(
            "charge",
            json!({ "order": "o-1", "cents": 501 }),
            None,
        ))
        .await
        .unwrap();
    assert_eq!(ledger.runs("o-1"), 3);

    // A tool left unguarded runs every time, and guarded tools say they are idempotent.
    second
        .call_tool(CallToolRequestParams::new("count"))
        .await
        .unwrap();
    second
        .call_tool(CallToolRequestParams::new("count"))
        .await
        .unwrap();
    assert_eq!(ledger.runs("count"), 2);
    let tools = second.list_all_tools().await.unwrap();
    let hint = |name: &str| {
        let tool = tools.iter().find(|t| t.name == name).unwrap();
        tool.annotations.as_ref().and_then(|a| a.idempotent_hint)
    };
    assert_eq!(hint("charge"), Some(true));
    assert_eq!(hint("count"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_meta_or_a_chosen_argument_names_the_call() {
    let store = MemoryStore::new();
    let shop = Shop::new(&store, Duration::from_secs(10), true);
    let ledger = shop.ledger.clone();
    let address = serve_http(shop).await;
    let client = http_client(address, Some("alice")).await;
    let args = json!({ "order": "o-2", "cents": 700 });

    // Two keys, equal arguments: two charges the client meant.
    for key in ["k-1", "k-2", "k-1"] {
        client
            .call_tool(call("charge", args.clone(), Some(key)))
            .await
            .unwrap();
    }
    assert_eq!(ledger.runs("o-2"), 2);

    // A key reused with other arguments: a tool error the model can read, nothing run.
    let reused = client
        .call_tool(call(
            "charge",
            json!({ "order": "o-2", "cents": 9 }),
            Some("k-1"),
        ))
        .await
        .unwrap();
    assert_eq!(reused.is_error, Some(true));
    assert_eq!(reason(&reused).as_deref(), Some("KEY_REUSED"));
    let text = serde_json::to_string(&reused.content).unwrap();
    assert!(text.contains("other arguments"), "{text}");
    assert_eq!(ledger.runs("o-2"), 2);

    // A malformed key: refused, nothing run.
    for key in [json!(""), json!(7), json!("é"), json!("k".repeat(256))] {
        let mut params = call("charge", args.clone(), None);
        let mut meta = RequestMetaObject::new();
        meta.insert(IDEMPOTENCY_KEY.to_owned(), key.clone());
        params.meta = Some(meta);
        let refused = client.call_tool(params).await.unwrap();
        assert_eq!(reason(&refused).as_deref(), Some("KEY_MALFORMED"), "{key}");
    }
    assert_eq!(ledger.runs("o-2"), 2);

    // `refund` is keyed on its order: the same order with another amount is refused.
    let refund = |cents: u64| call("refund", json!({ "order": "o-2", "cents": cents }), None);
    let first = client.call_tool(refund(100)).await.unwrap();
    let again = client.call_tool(refund(100)).await.unwrap();
    assert!(replayed(&again) && again.structured_content == first.structured_content);
    let other = client.call_tool(refund(200)).await.unwrap();
    assert_eq!(reason(&other).as_deref(), Some("KEY_REUSED"));
    assert_eq!(ledger.runs("refund o-2"), 1);
    let missing = client
        .call_tool(call("refund", json!({ "cents": 1 }), None))
        .await
        .unwrap();
    assert_eq!(reason(&missing).as_deref(), Some("KEY_MISSING"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_release_and_an_unknown_principal_is_refused() {
    let store = MemoryStore::new();
    let shop = Shop::new(&store, Duration::from_secs(10), true);
    let ledger = shop.ledger.clone();
    let address = serve_http(shop.clone()).await;
    let client = http_client(address, Some("alice")).await;

    // A tool error is the tool's answer, not recorded: a retry runs.
    let declined = json!({ "order": "declined", "cents": 1 });
    for run in 1..=2 {
        let answer = client
            .call_tool(call("charge", declined.clone(), None))
            .await
            .unwrap();
        assert_eq!(answer.is_error, Some(true));
        assert_eq!(reason(&answer), None, "the tool's own error");
        assert_eq!(ledger.runs("declined"), run);
    }

    // No principal over HTTP, and none at all over a byte stream: refused, nothing run.
    let anonymous = http_client(address, None).await;
    let refused = anonymous
        .call_tool(call("charge", json!({ "order": "o-3", "cents": 1 }), None))
        .await
        .unwrap();
    assert_eq!(reason(&refused).as_deref(), Some("PRINCIPAL_UNKNOWN"));
    let stream = stream_client(shop).await;
    let refused = stream
        .call_tool(call("charge", json!({ "order": "o-3", "cents": 1 }), None))
        .await
        .unwrap();
    assert_eq!(reason(&refused).as_deref(), Some("PRINCIPAL_UNKNOWN"));
    assert_eq!(ledger.runs("o-3"), 0);

    // Guarding a tool the router does not have is a configuration error.
    let idem = Idempotency::new(store).unscoped();
    let err = idem
        .guard("shop.v1", Shop::tool_router(), ["chrage"])
        .unwrap_err();
    assert!(matches!(err, idem_runtime::Error::Config(_)), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_waits_for_the_first_within_its_bound() {
    // Without the in-process registry, as a duplicate in another process: it claims, is
    // told the key is held, and waits on the store.
    let store = Probe::apart(MemoryStore::new());
    let shop = Shop::new(&store, Duration::from_secs(60), false);
    let ledger = shop.ledger.clone();
    let client = Arc::new(stream_client(shop.clone()).await);
    let args = json!({ "order": "slow-1", "cents": 5 });

    let first = tokio::spawn({
        let (client, args) = (client.clone(), args.clone());
        async move { client.call_tool(call("charge", args, None)).await.unwrap() }
    });
    ledger.started.notified().await;
    // The duplicate waits; the first is let go once the duplicate is waiting on the store.
    let second = tokio::spawn({
        let (client, args) = (client.clone(), args.clone());
        async move { client.call_tool(call("charge", args, None)).await.unwrap() }
    });
    until("the duplicate claimed the key", || store.claims() >= 2).await;
    ledger.release.add_permits(1);
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert!(!replayed(&first));
    assert!(
        replayed(&second),
        "the duplicate got the first call's result"
    );
    assert_eq!(second.structured_content, first.structured_content);
    assert_eq!(ledger.runs("slow-1"), 1);

    // With no wait, a duplicate of a running call is told when to come back.
    let impatient = Shop::new(&store, Duration::ZERO, false);
    let ledger = impatient.ledger.clone();
    let client = Arc::new(stream_client(impatient).await);
    let args = json!({ "order": "slow-2", "cents": 5 });
    let first = tokio::spawn({
        let (client, args) = (client.clone(), args.clone());
        async move { client.call_tool(call("charge", args, None)).await.unwrap() }
    });
    ledger.started.notified().await;
    let busy = client
        .call_tool(call("charge", args.clone(), None))
        .await
        .unwrap();
    assert_eq!(reason(&busy).as_deref(), Some("IN_FLIGHT"));
    let error = &busy.meta.as_ref().unwrap()[ERROR];
    assert!(error["retryAfterSeconds"].as_u64().unwrap() >= 1, "{error}");
    ledger.release.add_permits(1);
    first.await.unwrap();
    assert_eq!(ledger.runs("slow-2"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_releases_its_key() {
    let store = MemoryStore::new();
    let shop = Shop::new(&store, Duration::from_secs(10), false);
    let ledger = shop.ledger.clone();
    let client = Arc::new(stream_client(shop).await);
    let args = json!({ "order": "slow-3", "cents": 5 });

    // rmcp's client sends `notifications/cancelled` when its call is dropped.
    let cancelled = tokio::spawn({
        let (client, args) = (client.clone(), args.clone());
        async move { client.call_tool(call("charge", args, None)).await }
    });
    ledger.started.notified().await;
    cancelled.abort();
    until("the cancelled tool's future is dropped", || {
        ledger.dropped.load(Ordering::SeqCst) > 0
    })
    .await;
    assert_eq!(ledger.runs("slow-3"), 0, "the cancelled body never charged");

    // The key was released: the retry runs the tool, and is not told to wait.
    ledger.release.add_permits(1);
    let retried = client.call_tool(call("charge", args, None)).await.unwrap();
    assert!(
        !replayed(&retried) && retried.is_error != Some(true),
        "{retried:?}"
    );
    assert_eq!(ledger.runs("slow-3"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_replays_the_steps_of_its_first_round() {
    let store = MemoryStore::new();
    let shop = Shop::new(&store, Duration::from_secs(10), true);
    let ledger = shop.ledger.clone();
    let address = serve_http(shop).await;
    let client = http_client(address, Some("alice")).await;
    let args = json!({ "order": "o-4" });

    // The first round reserves, then asks for input: nothing is recorded as the result.
    let first = client
        .call_tool_once(call("ship", args.clone(), None))
        .await
        .unwrap();
    let CallToolResponse::InputRequired(asked) = first else {
        panic!("the first round asks for input: {first:?}");
    };
    assert_eq!(ledger.reservations.load(Ordering::SeqCst), 1);

    // The continuation (a new request, with the answers and the state echoed) replays the
    // reservation instead of reserving again, and completes.
    let mut continuation = call("ship", args.clone(), None);
    continuation.request_state = asked.request_state.clone();
    continuation.input_responses =
        Some([("confirm".to_owned(), json!({ "action": "accept" }))].into());
    let done = client.call_tool_once(continuation.clone()).await.unwrap();
    let CallToolResponse::Complete(done) = done else {
        panic!("the continuation completes: {done:?}");
    };
    assert_eq!(
        ledger.reservations.load(Ordering::SeqCst),
        1,
        "the step was not redone"
    );
    let shipped = done.structured_content.clone().unwrap();
    assert_eq!(shipped["hold"], "hold-1");
    assert_eq!(shipped["run"], 1);

    // Sent again, the completed call replays.
    let again = client.call_tool_once(continuation).await.unwrap();
    let CallToolResponse::Complete(again) = again else {
        panic!("{again:?}");
    };
    assert!(replayed(&again));
    assert_eq!(ledger.runs("ship o-4"), 1);
    assert_eq!(ledger.reservations.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_whose_record_fails_is_answered_marked_unrecorded() {
    // Every completion fails: the record is retried until the lease runs out.
    let store = Probe::new(MemoryStore::new());
    store.fail_completes(usize::MAX);
    let idem = Idempotency::new(store.clone())
        .lease(Duration::from_millis(300))
        .unscoped();
    let shop = Shop::with_tools(
        idem.guard("shop.v1", Shop::tool_router(), ["charge"])
            .unwrap(),
    );
    let ledger = shop.ledger.clone();
    let client = stream_client(shop).await;
    let answer = client
        .call_tool(call("charge", json!({ "order": "o-5", "cents": 5 }), None))
        .await
        .unwrap();
    // The tool ran: its own result, not an error that would hide the charge.
    assert_eq!(ledger.runs("o-5"), 1);
    assert_ne!(answer.is_error, Some(true), "{answer:?}");
    assert_eq!(answer.structured_content.as_ref().unwrap()["order"], "o-5");
    let marked = answer.meta.as_ref().and_then(|m| m.get(UNRECORDED));
    assert_eq!(marked, Some(&Value::Bool(true)), "{answer:?}");
    assert!(!replayed(&answer));
    assert!(store.completes() >= 2, "the record was retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_a_call_created_is_the_answer_to_its_retry() {
    let store = MemoryStore::new();
    let shop = Shop::new(&store, Duration::from_secs(10), true);
    let ledger = shop.ledger.clone();
    let address = serve_http(shop).await;
    // A client that takes tasks (SEP-2663), which the server asks of it.
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{address}/mcp"))
        .auth_header("alice");
    let tasks = ClientConfig::new(
        ClientCapabilities::builder().enable_tasks().build(),
        Implementation::new("idem-tests", "0.1.0"),
    );
    let modern = ClientLifecycleMode::Discover {
        preferred_versions: vec![ProtocolVersion::V_2026_07_28],
    };
    let client = tasks
        .serve_with_lifecycle(StreamableHttpClientTransport::from_config(config), modern)
        .await
        .unwrap();
    let started = |answer: CallToolResponse| match answer {
        CallToolResponse::Task(task) => task,
        other => panic!("a task: {other:?}"),
    };
    let first = started(
        client
            .call_tool_once(call("export", json!({ "order": "o-6" }), None))
            .await
            .unwrap(),
    );
    let again = started(
        client
            .call_tool_once(call("export", json!({ "order": "o-6" }), None))
            .await
            .unwrap(),
    );
    assert_eq!(ledger.runs("export o-6"), 1, "one task, not two");
    assert_eq!(again.task.task_id, first.task.task_id);
    let marked = again.meta.as_ref().and_then(|m| m.get(REPLAYED));
    assert_eq!(marked, Some(&Value::Bool(true)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_not_kept_is_gone_and_a_store_down_runs_nothing() {
    // A result larger than the memory store keeps: done, and not replayable.
    let store = MemoryStore::builder().max_bytes(1024).build();
    let shop = Shop::new(&store, Duration::from_secs(10), false);
    let ledger = shop.ledger.clone();
    let client = stream_client(shop).await;
    let big = json!({ "order": "big", "cents": 1 });
    let first = client
        .call_tool(call("charge", big.clone(), None))
        .await
        .unwrap();
    assert_ne!(first.is_error, Some(true), "{first:?}");
    let gone = client.call_tool(call("charge", big, None)).await.unwrap();
    assert_eq!(reason(&gone).as_deref(), Some("GONE"), "{gone:?}");
    assert_eq!(ledger.runs("big"), 1, "never a second run");

    // A store that is down: the tool does not run, and the error says nothing of it.
    let shop = Shop::new(&Down, Duration::from_secs(10), false);
    let ledger = shop.ledger.clone();
    let client = stream_client(shop).await;
    let down = client
        .call_tool(call("charge", json!({ "order": "o-7", "cents": 1 }), None))
        .await
        .unwrap();
    assert_eq!(
        reason(&down).as_deref(),
        Some("STORE_UNAVAILABLE"),
        "{down:?}"
    );
    assert_eq!(ledger.runs("o-7"), 0);
    let text = serde_json::to_string(&down).unwrap();
    for internal in ["hunter2", "db.internal", "connection refused"] {
        assert!(
            DOWN.contains(internal) && !text.contains(internal),
            "no internal text: {text}"
        );
    }
}
