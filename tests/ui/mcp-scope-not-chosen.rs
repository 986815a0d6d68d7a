// MCP tools guarded before choosing whose keys they are: refused at compile time, with the
// two choices named.
use idem_runtime::mcp::Idempotency;
use idem_runtime::MemoryStore;
use rmcp::handler::server::router::tool::ToolRouter;

struct Payments;

fn tools(router: ToolRouter<Payments>) -> Result<ToolRouter<Payments>, idem_runtime::Error> {
    let idem = Idempotency::new(MemoryStore::new());
    idem.guard("payments.v1", router, ["charge"])
}

fn main() {
    let _ = tools;
}
