"""An MCP server for tests/test_mcp_tools.py (the official SDK's ``MCPServer``): ``echo``, ``add``,
and tools that misbehave as real servers do — ``boom`` raises, ``hang`` never answers,
``die`` kills the server mid-call. ``python tests/mcp_test_server.py NAME`` serves over stdio;
``--http`` serves streamable HTTP on a free port and prints its URL alone on stdout."""

from __future__ import annotations

import os
import socket
import sys

import anyio
import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError


def build(name: str) -> MCPServer:
    server = MCPServer(name, log_level="CRITICAL")

    @server.tool(description=f"Echo the text back, prefixed by the server's name ({name}).")
    def echo(text: str) -> str:
        return f"{name}: {text}"

    @server.tool(description="Add two integers.")
    def add(a: int, b: int) -> str:
        return str(a + b)

    @server.tool(description="Always raises (a ToolError's message reaches the client; others' do not).")
    def boom() -> str:
        raise ToolError("boom went the tool")

    @server.tool(description="Never answers.")
    async def hang() -> str:
        await anyio.sleep_forever()
        return ""

    @server.tool(description="Kills the server.")
    def die() -> str:
        os._exit(3)

    return server


async def serve_http(server: MCPServer) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # before the URL goes out: a client that connects first waits in the backlog, not refused
    print(f"http://127.0.0.1:{sock.getsockname()[1]}/mcp", flush=True)
    await uvicorn.Server(uvicorn.Config(server.streamable_http_app(), log_level="warning")).serve(sockets=[sock])


if __name__ == "__main__":
    server = build(sys.argv[1])
    if "--http" in sys.argv:
        anyio.run(serve_http, server)
    else:
        server.run("stdio")
