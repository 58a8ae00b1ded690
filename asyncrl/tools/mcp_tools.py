"""An agent's tools from MCP servers: list them as OpenAI ``tools``, run the model's tool calls.

``async with MCPTools(servers, timeout_s=30) as tools:`` connects to every server (a stdio
command started here and stopped on leaving, or a streamable-HTTP URL), lists their tools
into ``tools.openai_tools`` (what ``chat.completions.create(tools=...)`` takes) and
``await tools.call(tool_call)`` runs one of the model's calls, returning the text for the
``tool`` message. Open it per episode (or around whatever owns the servers' lifetime).

Promises:

- **Names.** A tool keeps its name unless two servers offer the same one; then each copy is
  ``<server>__<tool>`` (said once in a warning), so a name in ``openai_tools`` routes to
  exactly one server and tool.
- **What fails the episode.** A server that cannot start, errors at the protocol level,
  dies, or does not answer within ``timeout_s`` raises ``MCPToolError`` naming the server
  and the tool: the agent's ``run`` raises, asyncrl counts that episode as an error
  (``errors.jsonl``, retried up to ``workflow.max_retries``) and the run goes on. A tool
  that reports an error itself (``isError``) raises too unless ``tool_errors="message"``,
  which hands its text to the model as MCP intends. What the *model* got wrong (a name
  no server offers, arguments that are not a JSON object) is a tool message: the model's
  mistake is the episode's information, not infrastructure failing.
- **Never hangs.** Every connect, listing and call runs under ``timeout_s``; stopping a
  stdio server is bounded by the SDK (terminate, then kill); an HTTP server is reached
  with an HTTP client whose every timeout is ``timeout_s``.
- **Owned, every failure surfaced.** Each server lives in its own task of one anyio task
  group that ``MCPTools`` enters and leaves: the SDK's transports are task groups whose
  cancel scopes must be left by the task that entered them, so a server's connection is
  opened and closed in that server's task, and servers connect side by side. A server
  task never raises into the agent's code: what ends it (a dead process, a broken
  stream, a failure while closing) is recorded, naming the server, and raised by the
  next call to it and by leaving the block (unless the block is already raising).

Needs the ``mcp`` SDK (``pip install -e ".[mcp]"``).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from asyncrl.tools.toolbox import call_arguments, call_parts

try:
    import anyio
    import httpx2
    from mcp import ClientSession, StdioServerParameters, stdio_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.types import PaginatedRequestParams
except ImportError as exc:  # pragma: no cover - the optional extra
    raise ImportError(f"asyncrl.tools.mcp_tools needs the MCP SDK: pip install -e \".[mcp]\" ({exc})") from exc

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI accepts as a function name


class MCPToolError(RuntimeError):
    """A server failed, errored or did not answer: the episode fails, naming ``server`` and ``tool``."""

    def __init__(self, server: str, tool: str | None, problem: str) -> None:
        what = f"MCP server {server!r}" + (f", tool {tool!r}" if tool else "")
        super().__init__(f"{what}: {problem}")
        self.server = server
        self.tool = tool


@dataclass(frozen=True)
class MCPServerSpec:
    """One server: ``command`` (stdio: the argv started per ``MCPTools``) or ``url`` (streamable HTTP)."""

    name: str
    command: tuple[str, ...] | None = None
    url: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # stdio: added to the SDK's default environment
    cwd: str | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or "__" in self.name:
            raise ValueError(f"MCP server name {self.name!r}: letters, digits, '_' and '-' only, no '__' "
                             "(it prefixes tool names on a clash)")
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: give exactly one of command (stdio) and url (streamable "
                             f"HTTP), e.g. {{'name': {self.name!r}, 'command': ['python', '-m', 'my.server']}}")
        if self.command is not None and (isinstance(self.command, str) or not self.command):
            raise ValueError(f"MCP server {self.name!r}: command is a non-empty list of arguments, "
                             f"not {self.command!r}")

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> MCPServerSpec:
        """From JSON/YAML: ``{"name", "command": [...]}`` or ``{"name", "url"}``, optional ``env``, ``cwd``."""
        unknown = set(spec) - {"name", "command", "url", "env", "cwd"}
        if unknown or "name" not in spec:
            raise ValueError(f"MCP server {spec!r}: needs 'name' and one of 'command'/'url'"
                             + (f"; unknown keys {sorted(unknown)}" if unknown else ""))
        command = spec.get("command")
        return cls(name=spec["name"], command=tuple(command) if isinstance(command, list) else command,
                   url=spec.get("url"), env=dict(spec.get("env") or {}), cwd=spec.get("cwd"))


@dataclass(frozen=True)
class _Route:
    server: str
    tool: str  # the name the server knows it by


class MCPTools:
    """The tools of several MCP servers behind one OpenAI ``tools`` list, a ``ToolBox``
    (``asyncrl/tools/toolbox.py``); see the module docstring."""

    def __init__(self, servers: list[MCPServerSpec | dict[str, Any]], *, timeout_s: float = 30.0,
                 tool_errors: Literal["raise", "message"] = "raise", http_client: httpx2.AsyncClient | None = None,
                 ) -> None:
        """``http_client``: the client URL servers are reached with, yours to keep open and close (one
        per event loop saves each episode building its own); default: one of its own, every timeout
        ``timeout_s``, closed on leaving."""
        specs = [s if isinstance(s, MCPServerSpec) else MCPServerSpec.from_dict(s) for s in servers]
        twice = [name for name, n in Counter(s.name for s in specs).items() if n > 1]
        if not specs or twice:
            raise ValueError(f"MCPTools needs servers with distinct names; got {[s.name for s in specs]}")
        if timeout_s <= 0 or tool_errors not in ("raise", "message"):
            raise ValueError(f"MCPTools: timeout_s > 0 and tool_errors 'raise'|'message', got {timeout_s}, "
                             f"{tool_errors!r}")
        self.servers = specs
        self.timeout_s = timeout_s
        self.tool_errors = tool_errors
        self.http_client = http_client
        self.openai_tools: list[dict[str, Any]] = []
        self._routes: dict[str, _Route] = {}
        self._sessions: dict[str, ClientSession] = {}
        self._listed: dict[str, list[Any]] = {}
        self._failures: dict[str, MCPToolError] = {}  # a server's task ended with this: every later use raises it
        self._ready = {spec.name: anyio.Event() for spec in specs}
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._stop = anyio.Event()
        self._group: Any = None

    async def __aenter__(self) -> Self:
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        try:
            for spec in self.servers:
                self._group.start_soon(self._own, spec)
            with anyio.move_on_after(self.timeout_s):
                for event in self._ready.values():
                    await event.wait()
            for spec in self.servers:
                if not self._ready[spec.name].is_set():
                    self._fail(spec.name, None, f"connecting ({_where(spec)}) got no answer within "
                               f"{self.timeout_s:g} s (timeout_s); is the server hung or slow to start?")
                    self._scopes[spec.name].cancel()
        except BaseException as exc:  # cancelled while connecting: stop what started, then go on out
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        if self._failures:
            await self.__aexit__(None, None, None)  # raises the first server's failure, after all are stopped
        self._route([(spec.name, tool) for spec in self.servers for tool in self._listed[spec.name]])
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        """Stop every server (each task leaves its own stack) and wait for them; then raise the
        first server failure, unless the block is already raising."""
        self._stop.set()
        # the block's own error propagates as it is (handed to the group it would come out wrapped in
        # an exception group); a cancellation is handed on, so the group cancels the servers' tasks
        cancelled = exc is not None and not isinstance(exc, Exception)
        await self._group.__aexit__(*((exc_type, exc, tb) if cancelled else (None, None, None)))
        if exc_type is None and self._failures:
            raise next(iter(self._failures.values()))

    async def call(self, tool_call: Any) -> str:
        """Run one of the model's calls (an SDK ``tool_call`` or its dict form) and return the
        text for its ``tool`` message: the result's text parts, one per line (other content
        as its JSON). Raises ``MCPToolError`` as the module docstring says."""
        name, arguments = call_parts(tool_call)
        route = self._routes.get(name)
        if route is None:
            return f"unknown tool: {name} (tools: {', '.join(self._routes)})"
        parsed = call_arguments(arguments)
        if parsed is None:
            return f"{name}: the arguments must be a JSON object, got {arguments!r}"
        if route.server in self._failures:
            raise self._failures[route.server]
        try:
            with anyio.fail_after(self.timeout_s):
                result = await self._sessions[route.server].call_tool(route.tool, parsed)
        except TimeoutError as exc:
            raise MCPToolError(route.server, route.tool, f"no answer within {self.timeout_s:g} s (timeout_s); "
                               "is the server hung or overloaded?") from exc
        except Exception as exc:  # the SDK's MCPError, a dead process's closed stream, an HTTP error
            raise self._failures.get(route.server) or MCPToolError(
                route.server, route.tool, f"the call failed: {_describe(exc)}") from exc
        text = "\n".join(part.text if getattr(part, "type", None) == "text" else part.model_dump_json()
                         for part in result.content)
        if result.is_error and self.tool_errors == "raise":
            raise MCPToolError(route.server, route.tool, f"the tool reported an error: {text[:500]} "
                               "(tool_errors='message' hands such errors to the model instead)")
        return text

    async def _own(self, spec: MCPServerSpec) -> None:
        """One server's whole life, in its own task (the transport's task group and cancel scopes
        are entered and left here): start or reach it, initialize, list its tools (every page),
        say ready, hold the connection until ``__aexit__``, close. Never raises: a failure is
        recorded, naming the server, for the next call and ``__aexit__`` to raise."""
        with anyio.CancelScope() as self._scopes[spec.name]:
            try:
                async with AsyncExitStack() as stack:
                    if spec.command is not None:
                        params = StdioServerParameters(command=spec.command[0], args=list(spec.command[1:]),
                                                       env=spec.env or None, cwd=spec.cwd)
                        read, write = await stack.enter_async_context(stdio_client(params))
                    else:
                        http = self.http_client
                        if http is None:
                            http = await stack.enter_async_context(httpx2.AsyncClient(timeout=self.timeout_s))
                        client = streamable_http_client(spec.url, http_client=http)
                        read, write = await stack.enter_async_context(client)
                    session = await stack.enter_async_context(ClientSession(read, write))
                    await session.initialize()
                    tools, cursor = [], None
                    while True:
                        page = await session.list_tools(
                            params=None if cursor is None else PaginatedRequestParams(cursor=cursor))
                        tools += page.tools
                        if not (cursor := page.next_cursor):
                            break
                    self._sessions[spec.name], self._listed[spec.name] = session, tools
                    self._ready[spec.name].set()
                    await self._stop.wait()
            except Exception as exc:  # noqa: BLE001 - recorded, raised by the next call and by __aexit__
                doing = "the session" if self._ready[spec.name].is_set() else f"connecting ({_where(spec)})"
                self._fail(spec.name, None, f"{doing} failed: {_describe(exc)}")
            finally:
                self._ready[spec.name].set()

    def _fail(self, server: str, tool: str | None, problem: str) -> None:
        if server not in self._failures:
            self._failures[server] = MCPToolError(server, tool, problem)
            log.warning("%s", self._failures[server])

    def _route(self, listed: list[tuple[str, Any]]) -> None:
        counts = Counter(tool.name for _, tool in listed)
        clashes = sorted(name for name, n in counts.items() if n > 1)
        if clashes:
            log.warning("MCP tools offered by several servers are named <server>__<tool>: %s", ", ".join(clashes))
        for server, tool in listed:
            name = f"{server}__{tool.name}" if counts[tool.name] > 1 else tool.name
            self._routes[name] = _Route(server, tool.name)
            self.openai_tools.append({"type": "function", "function": {
                "name": name, "description": tool.description or "", "parameters": tool.input_schema}})


def _where(spec: MCPServerSpec) -> str:
    return " ".join(spec.command) if spec.command is not None else str(spec.url)


def _describe(exc: BaseException) -> str:
    """An exception group's leaves, else the exception: what went wrong, not the group's wrapper."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
