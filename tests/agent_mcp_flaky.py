"""A test agent whose tool comes from an MCP server that dies on the first episode of each task:
that episode fails naming the server and tool, asyncrl retries it, and the run goes on."""

import sys
from pathlib import Path

from openai import AsyncOpenAI

from asyncrl.tools.mcp_tools import MCPTools

SERVER = {"name": "flaky", "command": [sys.executable, str(Path(__file__).with_name("mcp_test_server.py")), "flaky"]}
_seen: set[str] = set()


async def run(task, base_url: str) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}])
    first = task.id not in _seen
    _seen.add(task.id)
    async with MCPTools([SERVER], timeout_s=20) as tools:
        text = await tools.call({"function": {"name": "die" if first else "echo", "arguments": '{"text": "ok"}'}})
    return float(text == "flaky: ok")
