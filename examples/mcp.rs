//! An MCP server whose `charge` tool charges an order once, however often an agent calls
//! it: the records in Redis, the charges in PostgreSQL, and `reconcile` asking the ledger
//! when a server died between the two.
//!
//! ```text
//! cargo run -p idem-examples --example mcp               # Streamable HTTP on 127.0.0.1:8765/mcp
//! cargo run -p idem-examples --example mcp -- --stdio    # over stdio, for a desktop agent
//! ```
//!
//! Redis on 127.0.0.1:6379 and PostgreSQL on 127.0.0.1:5432 (`IDEM_REDIS_URL`,
//! `IDEM_POSTGRES_URL` point elsewhere; `IDEM_MCP_ADDR` is the HTTP address). Over HTTP a
//! call's principal is its `Authorization` header; over stdio the server is its user's alone.
//! `examples/mcp_test.rs` charges 1 000 orders through a network that loses every third
//! connection's answers while it SIGKILLs this server mid-tool, and checks that every order
//! was charged once.

use std::net::SocketAddr;
use std::time::Duration;

use idem_runtime::mcp::Idempotency;
use idem_runtime::{reconcile, BoxError, Error, RedisStore};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock};
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{tool, tool_handler, tool_router, ErrorData, ServerHandler, ServiceExt};
use serde::Deserialize;
use sqlx::PgPool;

/// What the server is started with.
pub struct Config {
    pub redis_url: String,
    pub postgres_url: String,
    pub address: SocketAddr,
    /// Serve over stdin and stdout instead of HTTP.
    pub stdio: bool,
    /// For the kill test: a charge of an order that starts with this stops after the charge,
    /// before its answer, as a server that dies there.
    pub stall_after_charge: Option<String>,
}

impl Config {
    pub fn from_env() -> Self {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
        Self {
            redis_url: var("IDEM_REDIS_URL", "redis://127.0.0.1:6379"),
            postgres_url: var(
                "IDEM_POSTGRES_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            address: var("IDEM_MCP_ADDR", "127.0.0.1:8765")
                .parse()
                .expect("IDEM_MCP_ADDR"),
            stdio: std::env::args().any(|arg| arg == "--stdio"),
            stall_after_charge: std::env::var("IDEM_MCP_STALL_AFTER_CHARGE").ok(),
        }
    }
}

#[derive(Deserialize, schemars::JsonSchema)]
pub struct Charge {
    /// The order to charge.
    pub order: String,
    /// How much, in cents.
    pub cents: i64,
}

#[derive(Clone)]
pub struct Payments {
    tools: ToolRouter<Self>,
    ledger: PgPool,
    stall_after_charge: Option<String>,
    /// Where the server says what it did: stdout over HTTP, stderr over stdio.
    stdio: bool,
}

#[tool_router]
impl Payments {
    #[tool(description = "Charge an order. Safe to call again: an order is charged once.")]
    async fn charge(&self, Parameters(c): Parameters<Charge>) -> Result<CallToolResult, ErrorData> {
        // Only after a server died mid-charge, or mid-answer: did its charge land?
        let charged = async { self.charged(&c.order).await.map_err(Error::store) };
        if let Some(id) = reconcile(charged).await.map_err(unavailable)? {
            self.say(&format!("reconciled {}", c.order));
            return Ok(receipt(&c, id));
        }
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO idem_example_mcp_charges (order_id, cents) VALUES ($1, $2) RETURNING id",
        )
        .bind(&c.order)
        .bind(c.cents)
        .fetch_one(&self.ledger)
        .await
        .map_err(|err| unavailable(Error::store(err)))?;
        self.say(&format!("charged {}", c.order));
        if let Some(prefix) = &self.stall_after_charge {
            // Only the order's first charge stalls: a second one (the bug the test looks
            // for) answers, so that the test counts it instead of waiting for it.
            if c.order.starts_with(prefix.as_str())
                && self.charged(&c.order).await.ok().flatten() == Some(id)
            {
                std::future::pending::<()>().await;
            }
        }
        Ok(receipt(&c, id))
    }
}

#[tool_handler(router = self.tools)]
impl ServerHandler for Payments {}

impl Payments {
    /// The charge of `order` in the ledger, if it has one.
    async fn charged(&self, order: &str) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT id FROM idem_example_mcp_charges WHERE order_id = $1 ORDER BY id LIMIT 1",
        )
        .bind(order)
        .fetch_optional(&self.ledger)
        .await
    }

    fn say(&self, line: &str) {
        if self.stdio {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    }
}

fn receipt(charge: &Charge, id: i64) -> CallToolResult {
    let mut result = CallToolResult::structured(serde_json::json!({
        "order": charge.order, "cents": charge.cents, "charge": id,
    }));
    result.content.insert(
        0,
        ContentBlock::text(format!(
            "Charged {} cents for order {} (charge {id}).",
            charge.cents, charge.order
        )),
    );
    result
}

/// A ledger that cannot answer: a protocol error, the key released (or, after a takeover,
/// left to lapse), so that a retry asks again. Its text stays in the log.
fn unavailable(err: Error) -> ErrorData {
    eprintln!("the ledger failed: {err}");
    ErrorData::internal_error("the ledger is unavailable: call again in a moment", None)
}

/// Runs the server until `stopped` resolves (or, over stdio, until stdin closes).
pub async fn serve(
    config: Config,
    stopped: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), BoxError> {
    let ledger = PgPool::connect(&config.postgres_url).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS idem_example_mcp_charges (id bigserial PRIMARY KEY, order_id text NOT NULL, cents bigint NOT NULL)",
    )
    .execute(&ledger)
    .await?;
    let store = RedisStore::connect(&config.redis_url).await?;
    // A killed server's claims lapse after 5 s, and are then taken over and reconciled. A
    // live server renews its claims well within that, however busy its machine.
    let idem = Idempotency::new(store).lease(Duration::from_secs(5));
    let tools = Payments::tool_router();
    let tools = if config.stdio {
        idem.unscoped().guard("payments.v1", tools, ["charge"])?
    } else {
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
        .guard("payments.v1", tools, ["charge"])?
    };
    let payments = Payments {
        tools,
        ledger,
        stall_after_charge: config.stall_after_charge,
        stdio: config.stdio,
    };
    if config.stdio {
        let running = payments.serve(rmcp::transport::stdio()).await?;
        running.waiting().await?;
        return Ok(());
    }
    let http = StreamableHttpService::new(
        move || Ok(payments.clone()),
        std::sync::Arc::new(NeverSessionManager::default()),
        StreamableHttpServerConfig::default().with_legacy_session_mode(false),
    );
    let app = axum::Router::new().nest_service("/mcp", http);
    let listener = tokio::net::TcpListener::bind(config.address).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(stopped)
        .await?;
    Ok(())
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), BoxError> {
    serve(Config::from_env(), async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}
