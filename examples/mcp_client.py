"""The MCP project's own Python SDK (`pip install 'mcp>=2'`) as a second client of the
server in `mcp.rs`, a peer nobody here wrote: each call a session of its own, as an agent
that retries after a lost answer makes.

    python3 examples/mcp_client.py http://127.0.0.1:8765/mcp RUN

charges order `RUN-py-1` twice and expects one charge, the second answer the first's,
marked replayed; calls it again with a `_meta` key, then reuses that key with another
amount and expects the tool error `KEY_REUSED`. Prints what it got; exits 1 if a check fails.
`examples/mcp_test.rs` runs it against the server in a process of its own.
"""

import asyncio
import sys

from mcp import ClientSession
from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client


async def call(url, arguments, meta=None):
    """One session, one `tools/call` of `charge`: the result, as the SDK parsed it."""
    http = create_mcp_http_client(headers={"Authorization": "Bearer python-agent"})
    async with http:
        async with streamable_http_client(url, http_client=http) as (read, write, *_):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await session.call_tool("charge", arguments, meta=meta)


def meta_of(result):
    return getattr(result, "meta", None) or {}


def check(what, holds):
    print(("ok      " if holds else "FAILED  ") + what)
    return holds


async def main(url, run):
    order = {"order": f"{run}-py-1", "cents": 250}
    first = await call(url, order)
    again = await call(url, {"cents": 250, "order": f"{run}-py-1"})
    print("first:", first.structured_content, meta_of(first))
    print("again:", again.structured_content, meta_of(again))
    checks = [
        check("the first call charged", not first.is_error and first.structured_content["charge"] > 0),
        check("the retry is the first's answer", again.structured_content == first.structured_content),
        check("the retry is marked replayed", meta_of(again).get("rs.idem/replayed") is True),
        check("the first is not", "rs.idem/replayed" not in meta_of(first)),
    ]
    key = {"rs.idem/idempotency-key": f"{run}-py-key"}
    keyed = await call(url, {"order": f"{run}-py-2", "cents": 1}, meta=key)
    reused = await call(url, {"order": f"{run}-py-2", "cents": 2}, meta=key)
    print("reused:", [c.text for c in reused.content], meta_of(reused))
    checks += [
        check("a keyed call charged", not keyed.is_error),
        check("its key with another amount is a tool error", reused.is_error is True),
        check(
            "whose reason is KEY_REUSED",
            meta_of(reused).get("rs.idem/error", {}).get("reason") == "KEY_REUSED",
        ),
    ]
    return all(checks)


if __name__ == "__main__":
    sys.exit(0 if asyncio.run(main(sys.argv[1], sys.argv[2])) else 1)
