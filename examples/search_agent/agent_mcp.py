"""The multi-hop search agent of ``agent.py`` with its tool from an MCP server.

Same question, prompts, turn limit, nudge and reward as ``agent.py`` (it reuses that
file's conversation, ``converse_with_tools``): only where ``search`` comes from differs.
Each episode opens ``MCPTools`` (``asyncrl/tools/mcp_tools.py``) on the servers, offers the
model the tools they list and runs its calls there; a server that fails, errors or does
not answer within ``TIMEOUT_S`` fails the episode (asyncrl retries it, the run goes on).

Which servers:

- ``ASYNCRL_MCP_SERVERS`` set: that JSON list, as ``MCPTools`` reads it, e.g.
  ``[{"name": "retrieval", "url": "http://127.0.0.1:8200/mcp"}]`` or
  ``[{"name": "retrieval", "command": ["python", "-m", "asyncrl.tools.retrieval.mcp_server",
  "--docs", "corpus.jsonl"]}]`` (a stdio server is started per episode: ~1 s of a core each).
- otherwise one streamable-HTTP server of its own per process,
  ``python -m asyncrl.tools.retrieval.mcp_server --http`` over the task's corpus (as
  ``agent.py`` writes it; ``ASYNCRL_MULTIHOP_OPTIONS`` and ``ASYNCRL_RETRIEVAL_LATENCY_S``
  are read the same way), stopped at interpreter exit.

A tool result is the hits' texts cut as ``agent.py`` cuts them (``format_result``). A
tool's own error (the model's arguments did not fit the schema) reaches the model as its
result, as ``agent.py``'s "search needs a query" does (``tool_errors="message"``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import weakref
from pathlib import Path

import httpx2

from asyncrl.plugins import load_named
from asyncrl.tasks.multihop import multihop_reward
from asyncrl.tools.mcp_tools import MCPTools

# agent.py, loaded as asyncrl loads an agent file (the same module object when both are used)
plain = sys.modules[load_named(f"{Path(__file__).with_name('agent.py')}:run", key="agent_mcp").__module__]

TIMEOUT_S = 30.0  # a search answers in ~20 ms; 64 episodes connecting at once on a loaded machine take seconds
_lock = threading.Lock()
_servers: list[dict] | None = None
_http_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> httpx2.AsyncClient


def mcp_servers() -> list[dict]:
    """``ASYNCRL_MCP_SERVERS``, or this process's own retrieval MCP server, started on first use."""
    global _servers
    if spec := os.environ.get("ASYNCRL_MCP_SERVERS"):
        return json.loads(spec)
    with _lock:
        if _servers is None:
            options = json.loads(os.environ.get("ASYNCRL_MULTIHOP_OPTIONS") or "{}")
            latency = os.environ.get("ASYNCRL_RETRIEVAL_LATENCY_S", "0.02")
            url = plain.start_subprocess_service(["asyncrl.tools.retrieval.mcp_server", "--http", "--docs",
                                            str(plain.corpus_path(options)), "--latency-s", latency])
            _servers = [{"name": "retrieval", "url": url}]
    return _servers


def http_client() -> httpx2.AsyncClient:
    """One HTTP client per event loop for every episode's MCP connections: building one costs
    more CPU than an episode's searches (its TLS context), and 64 episodes connect at once."""
    loop = asyncio.get_running_loop()
    if loop not in _http_clients:
        _http_clients[loop] = httpx2.AsyncClient(timeout=TIMEOUT_S)
    return _http_clients[loop]


async def run(task, base_url: str) -> float:
    servers = mcp_servers() if _servers is not None else await asyncio.to_thread(mcp_servers)  # start off the loop
    async with MCPTools(servers, timeout_s=TIMEOUT_S, tool_errors="message", http_client=http_client()) as tools:
        async def run_tool(call) -> str:
            return plain.format_result((await tools.call(call)).splitlines())

        final = await plain.converse_with_tools(plain.sdk_client(base_url), task, tools.openai_tools, run_tool)
    return multihop_reward(task, final)
