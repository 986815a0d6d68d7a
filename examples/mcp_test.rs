//! The MCP server of `mcp.rs` in a process of its own, driven by rmcp's own client: 1 000
//! charges through a network that loses every third connection's answers, each retried
//! with a new JSON-RPC request on a new connection, while the server is SIGKILLed mid-tool
//! (after its charge, before its answer) a dozen times; and over stdio, a replay and a kill.
//! Every order is charged once, and every client gets its own order's charge.

#[path = "mcp.rs"]
mod mcp;
#[path = "process.rs"]
mod process;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::mcp::{ERROR, IDEMPOTENCY_KEY, REPLAYED};
use process::{free_addr, stdin_closed, Service};
use rmcp::model::{CallToolRequestParams, CallToolResult, ProtocolVersion, RequestMetaObject};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{ClientLifecycleMode, ClientServiceExt, ServiceExt};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

const CHARGES: u64 = 1000;
const CONCURRENT: usize = 16;
const KILLS: u64 = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the MCP server over HTTP, started (and killed) by the tests below"]
async fn mcp_service() {
    mcp::serve(mcp::Config::from_env(), stdin_closed())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the MCP server over stdio, started (and killed) by the tests below"]
async fn mcp_stdio_service() {
    let mut config = mcp::Config::from_env();
    config.stdio = true;
    mcp::serve(config, std::future::pending()).await.unwrap();
}

/// The ledger, or `None` (the test skips) when Redis or PostgreSQL is not here.
async fn ledger() -> Option<PgPool> {
    let config = mcp::Config::from_env();
    let reachable = async {
        idem_runtime::RedisStore::connect(&config.redis_url).await?;
        let pool = PgPool::connect(&config.postgres_url)
            .await
            .map_err(idem_runtime::Error::store)?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS idem_example_mcp_charges (id bigserial PRIMARY KEY, order_id text NOT NULL, cents bigint NOT NULL)",
        )
        .execute(&pool)
        .await
        .map_err(idem_runtime::Error::store)?;
        Ok::<_, idem_runtime::Error>(pool)
    };
    match reachable.await {
        Ok(pool) => Some(pool),
        Err(e) => {
            assert!(
                std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(),
                "Redis and PostgreSQL are required (IDEM_REQUIRE_SERVICES): {e}"
            );
            eprintln!("skipped: Redis or PostgreSQL is unreachable ({e})");
            None
        }
    }
}

/// A name no earlier run used.
fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("mcp-{nanos}")
}

/// Each order's charges in the ledger: how many, and the first one's id.
async fn charges(ledger: &PgPool, run: &str) -> HashMap<String, (i64, i64)> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT order_id, count(*), min(id) FROM idem_example_mcp_charges WHERE order_id LIKE $1 GROUP BY order_id",
    )
    .bind(format!("{run}-%"))
    .fetch_all(ledger)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(order, n, id)| (order, (n, id)))
        .collect()
}

fn charge(order: &str, cents: i64) -> CallToolRequestParams {
    let arguments = json!({ "order": order, "cents": cents });
    CallToolRequestParams::new("charge").with_arguments(arguments.as_object().unwrap().clone())
}

fn replayed(result: &CallToolResult) -> bool {
    result.meta.as_ref().and_then(|m| m.get(REPLAYED)) == Some(&Value::Bool(true))
}

fn reason(result: &CallToolResult) -> Option<&str> {
    result.meta.as_ref()?.get(ERROR)?.get("reason")?.as_str()
}

/// One attempt: a new client (its own connections: nothing is pooled), the discovery, and
/// the call, with new JSON-RPC request ids. `Err` when the network or the server failed it.
async fn attempt(
    address: SocketAddr,
    params: CallToolRequestParams,
) -> Result<CallToolResult, String> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .map_err(|e| e.to_string())?;
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{address}/mcp"))
        .auth_header("agent-7");
    let transport = StreamableHttpClientTransport::with_client(http, config);
    let modern = ClientLifecycleMode::Discover {
        preferred_versions: vec![ProtocolVersion::V_2026_07_28],
    };
    let client = ().serve_with_lifecycle(transport, modern).await.map_err(|e| e.to_string())?;
    let answer = client.call_tool(params).await.map_err(|e| e.to_string());
    let _ = client.cancel().await;
    answer
}

/// Calls until the call is answered: a result, or a tool error that is not "come back
/// later". Returns the answer and the attempts it took.
async fn call_until_answered(
    address: SocketAddr,
    params: CallToolRequestParams,
) -> (CallToolResult, u32) {
    let mut backoff = Duration::from_millis(10);
    for attempts in 1..=2000 {
        match attempt(address, params.clone()).await {
            Ok(result) if !matches!(reason(&result), Some("IN_FLIGHT" | "STORE_UNAVAILABLE")) => {
                return (result, attempts)
            }
            Ok(_) | Err(_) => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(250));
            }
        }
    }
    panic!("{params:?} was never answered in 2000 attempts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_charge_once_through_kills_and_lost_answers() {
    let Some(ledger) = ledger().await else { return };
    let run = run_id();
    let server = free_addr();
    let hang = format!("{run}-hang-");
    let env = [
        ("IDEM_MCP_ADDR", server.to_string()),
        ("IDEM_MCP_STALL_AFTER_CHARGE", hang.clone()),
    ];
    let mut service = Service::start("mcp_service", &env);
    service.said("listening").await;
    let connections = Arc::new(AtomicU64::new(0));
    let proxy = lossy_proxy(server, connections.clone()).await;

    // The load: each order one logical charge, retried until answered.
    let (progress, mut done) = watch::channel(0_u64);
    let progress = Arc::new(progress);
    let permits = Arc::new(Semaphore::new(CONCURRENT));
    let attempts = Arc::new(AtomicU64::new(0));
    let mut calls = tokio::task::JoinSet::new();
    for n in 0..CHARGES {
        let (permits, progress, attempts) = (permits.clone(), progress.clone(), attempts.clone());
        let order = format!("{run}-{n}");
        calls.spawn(async move {
            let _permit = permits.acquire_owned().await.unwrap();
            let (answer, tries) = call_until_answered(proxy, charge(&order, 100 + n as i64)).await;
            attempts.fetch_add(u64::from(tries), Ordering::Relaxed);
            progress.send_modify(|done| *done += 1);
            (order, answer)
        });
    }

    // The kills: after each twelfth of the load, a charge that stops after the ledger has
    // it and before its answer; the server is killed there, and started again.
    let mut hung = Vec::new();
    for k in 0..KILLS {
        let due = (k + 1) * CHARGES / (KILLS + 1);
        done.wait_for(|done| *done >= due).await.unwrap();
        let order = format!("{hang}{k}");
        hung.push(tokio::spawn({
            let order = order.clone();
            async move {
                (
                    order.clone(),
                    call_until_answered(proxy, charge(&order, 7)).await.0,
                )
            }
        }));
        service.said(&format!("charged {order}")).await;
        service.kill();
        service = Service::start("mcp_service", &env);
        service.said("listening").await;
    }

    let mut answers = Vec::new();
    while let Some(call) = calls.join_next().await {
        answers.push(call.unwrap());
    }
    for call in hung {
        answers.push(call.await.unwrap());
    }

    // A key reused with other arguments, through the same network: a tool error.
    let with_key = |cents| {
        let mut params = charge(&format!("{run}-reused"), cents);
        let mut meta = RequestMetaObject::new();
        meta.insert(
            IDEMPOTENCY_KEY.to_owned(),
            Value::from(format!("{run}-key")),
        );
        params.meta = Some(meta);
        params
    };
    let (first, _) = call_until_answered(proxy, with_key(1)).await;
    assert_ne!(first.is_error, Some(true), "{first:?}");
    let (reused, _) = call_until_answered(proxy, with_key(2)).await;
    assert_eq!(reason(&reused), Some("KEY_REUSED"), "{reused:?}");
    service.finish().await;

    let ledger = charges(&ledger, &run).await;
    let mut replays = 0;
    for (order, answer) in &answers {
        assert_ne!(answer.is_error, Some(true), "{order}: {answer:?}");
        let receipt = answer.structured_content.as_ref().unwrap();
        let (n, id) = ledger.get(order).copied().unwrap_or_default();
        assert_eq!(n, 1, "order {order} was charged {n} times");
        assert_eq!(
            receipt["order"],
            order.as_str(),
            "the client got its own order's receipt"
        );
        assert_eq!(
            receipt["charge"], id,
            "{order}: the receipt is the ledger's charge"
        );
        if order.starts_with(&hang) {
            assert!(
                replayed(answer),
                "{order}: the killed call's charge was reconciled: {answer:?}"
            );
        }
        replays += u64::from(replayed(answer));
    }
    assert_eq!(
        ledger.len() as u64,
        CHARGES + KILLS + 1,
        "nothing else was charged"
    );
    let (connections, attempts) = (
        connections.load(Ordering::SeqCst),
        attempts.load(Ordering::SeqCst),
    );
    println!(
        "{CHARGES} charges and {KILLS} kills: {attempts} attempts over {connections} connections, {replays} answers replayed"
    );
    assert!(
        attempts > CHARGES,
        "answers were lost, so charges were retried"
    );
    assert!(
        replays > KILLS,
        "answers lost after their charge were replayed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stdio_server_replays_and_reconciles_after_a_kill() {
    let Some(ledger) = ledger().await else { return };
    let run = run_id();
    let hang = format!("{run}-hang");
    let start = || {
        let mut command = tokio::process::Command::new(std::env::current_exe().unwrap());
        command
            .args(["--ignored", "--exact", "mcp_stdio_service", "--nocapture"])
            .env("IDEM_MCP_STALL_AFTER_CHARGE", &hang);
        TokioChildProcess::new(command).unwrap()
    };

    let server = start();
    let pid = server.id().unwrap();
    let client = Arc::new(().serve(server).await.unwrap());
    let order = format!("{run}-1");
    let first = client.call_tool(charge(&order, 300)).await.unwrap();
    let again = client.call_tool(charge(&order, 300)).await.unwrap();
    assert!(!replayed(&first) && replayed(&again), "{again:?}");
    assert_eq!(again.structured_content, first.structured_content);

    // Killed after its charge, before its answer.
    let stalled = tokio::spawn({
        let (client, hang) = (client.clone(), hang.clone());
        async move { client.call_tool(charge(&hang, 9)).await }
    });
    let poll = async {
        while !charges(&ledger, &run).await.contains_key(&hang) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), poll)
        .await
        .expect("the stalled charge reached the ledger");
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    assert!(
        stalled.await.unwrap().is_err(),
        "the killed server answered nothing"
    );

    // Its next process takes the key over once the lease lapses, and asks the ledger.
    let client = ().serve(start()).await.unwrap();
    let (answer, tries) = loop_until_answered(&client, charge(&hang, 9)).await;
    assert!(
        replayed(&answer),
        "reconciled, not charged again: {answer:?} after {tries} tries"
    );
    let ledger = charges(&ledger, &run).await;
    assert_eq!(ledger[&hang].0, 1);
    assert_eq!(ledger[&order].0, 1);
    assert_eq!(
        answer.structured_content.unwrap()["charge"],
        ledger[&hang].1
    );
}

/// The MCP project's own Python SDK as a second client (`mcp_client.py`): a replay, its
/// marker, and a key reused with other arguments refused, as that SDK reads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mcp_projects_python_sdk_reads_replays_and_refusals() {
    let Some(_) = ledger().await else { return };
    let sdk = std::process::Command::new("python3")
        .args(["-c", "import mcp.client.streamable_http"])
        .status()
        .is_ok_and(|status| status.success());
    if !sdk {
        assert!(
            std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(),
            "the MCP Python SDK is required (IDEM_REQUIRE_SERVICES): pip install 'mcp>=2'"
        );
        eprintln!("skipped: the MCP Python SDK is not installed");
        return;
    }
    let server = free_addr();
    let mut service = Service::start("mcp_service", &[("IDEM_MCP_ADDR", server.to_string())]);
    service.said("listening").await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/mcp_client.py");
    let ran = tokio::process::Command::new("python3")
        .args([script, &format!("http://{server}/mcp"), &run_id()])
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&ran.stdout);
    println!("{said}{}", String::from_utf8_lossy(&ran.stderr));
    assert!(
        ran.status.success(),
        "the Python client's checks failed:\n{said}"
    );
    assert_eq!(
        said.matches("\nok ").count() + usize::from(said.starts_with("ok ")),
        7,
        "{said}"
    );
    service.finish().await;
}

/// Calls through `client` until the answer is not "come back later".
async fn loop_until_answered(
    client: &rmcp::service::RunningService<rmcp::RoleClient, ()>,
    params: CallToolRequestParams,
) -> (CallToolResult, u32) {
    for tries in 1..=100 {
        let answer = client.call_tool(params.clone()).await.unwrap();
        if reason(&answer) != Some("IN_FLIGHT") {
            return (answer, tries);
        }
    }
    panic!("{params:?} stayed in flight");
}

// ---- a lossy network -------------------------------------------------------------------

/// A TCP proxy to `upstream` whose every third connection loses the server's answer: the
/// request goes through, whatever comes back is dropped, with the connection. Counts the
/// connections.
async fn lossy_proxy(upstream: SocketAddr, connections: Arc<AtomicU64>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (client, _) = listener.accept().await.unwrap();
            let n = connections.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(relay(client, upstream, n % 3 == 2));
        }
    });
    address
}

async fn relay(client: TcpStream, upstream: SocketAddr, lossy: bool) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upward = tokio::spawn(async move {
        let mut buffer = vec![0; 16 * 1024];
        loop {
            let read = match client_read.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(read) => read,
            };
            if server_write.write_all(&buffer[..read]).await.is_err() {
                break;
            }
        }
    });
    let mut buffer = vec![0; 16 * 1024];
    loop {
        let read = match server_read.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        // An HTTP/1.1 server answers only after the request: whatever it sends is the answer.
        if lossy || client_write.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
    upward.abort();
}
