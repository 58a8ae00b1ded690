"""``python -m asyncrl.tools.retrieval.mcp_server --docs FILE.jsonl [--http] [--port 0]``: the
search agent's retrieval tool as an MCP server (the official SDK's ``MCPServer``).

One tool, ``search(query)``, described as the plain search agent describes its own: BM25
(or ``--index dense|hybrid``, ``dense.py``) over the documents (the same index as
``python -m asyncrl.tools.retrieval``), the best ``--k`` hits' texts, one per line,
whitespace collapsed; no line when nothing matches.
Over stdio by default (an agent's ``MCPTools`` starts it and stops it); ``--http`` serves
streamable HTTP (stateless, JSON replies) at ``http://HOST:PORT/mcp`` instead, printing that URL alone on stdout once
listening (``--port 0``, the default: a free port, so the URL is the only way to know it).
A bad documents file or a taken port exits 2 with one line saying which."""

from __future__ import annotations

import argparse
import socket
import sys

import anyio

from asyncrl.jsonl import JsonlError
from asyncrl.tools.retrieval.dense import build_index
from asyncrl.tools.retrieval.index import SearchIndex, load_documents

DESCRIPTION = "Search the knowledge base; returns the best matching documents."  # the plain agent's words


def build_server(index: SearchIndex, *, k: int, latency_s: float = 0.0):
    """The ``MCPServer`` with its one tool; ``latency_s`` is added to each search, as the HTTP service's is."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("asyncrl-retrieval", log_level="WARNING")

    @server.tool(name="search", description=DESCRIPTION, structured_output=False)
    async def search(query: str) -> str:
        if latency_s:
            await anyio.sleep(latency_s)
        return "\n".join(" ".join(hit["text"].split()) for hit in index.search(query, k))

    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.tools.retrieval.mcp_server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", required=True, help='JSONL, one {"id": str, "text": str} object a line')
    parser.add_argument("--k", type=int, default=3, help="hits per search")
    parser.add_argument("--latency-s", type=float, default=0.0, help="added to every search")
    parser.add_argument("--index", choices=["bm25", "dense", "hybrid"], default="bm25")
    parser.add_argument("--encoder", default="minilm", help="dense, hybrid: 'minilm' or a causal LM's path")
    parser.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="--http: 0 (the default) is a free one")
    args = parser.parse_args(argv)
    try:
        server = build_server(build_index(load_documents(args.docs), args.index, args.encoder), k=args.k,
                              latency_s=args.latency_s)
    except (JsonlError, ValueError, ImportError, OSError) as exc:
        print(f"retrieval mcp: {exc}", file=sys.stderr)
        return 2
    if not args.http:
        server.run("stdio")
        return 0
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"retrieval mcp: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    anyio.run(_serve_http, server, sock, args.host)
    return 0


async def _serve_http(server, sock: socket.socket, host: str) -> None:
    """uvicorn on a socket bound beforehand, so the URL printed is the port really listened on."""
    import uvicorn

    # stateless, JSON replies: a search keeps no state between requests, and a session per
    # episode (its own task and SSE stream on the server) is what made connecting slow under load
    app = server.streamable_http_app(host=host, stateless_http=True, json_response=True)
    # idle connections are kept longer than a client keeps them (httpx's 5 s): otherwise the server may
    # close one just as a client reuses it, and that request fails with a ReadError
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=60)
    print(f"http://{host}:{sock.getsockname()[1]}/mcp", flush=True)
    await uvicorn.Server(config).serve(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
