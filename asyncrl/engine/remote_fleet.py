"""The fleet behind ``engine: remote``: the servers as one client knows them, which one a
request goes to, control calls under deadlines, and what happens when a server is lost.

Invariants: a server is ``usable`` only after it was brought to the client's weights and
version (at connect, or revived); a loss is said once on stderr, naming the server, why,
and where its requests go; every call has a deadline and its failure names the server, the
call and the knob that bounds it. The weights a server is sent are ``remote_weights.py``'s;
the requests' wire format is ``remote_wire.py``'s.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from asyncrl.config import RemoteConfig
from asyncrl.engine.protocol import EngineClosedError
from asyncrl.engine.remote_wire import (ControlError, RemoteStats, Server, ServerLost, ServersUnusable, Wire,
                                        _describe, _error_message)

REFUSED_GRACE_S = 5.0
"""How long a refused connection is waited out at connect (a server binding its port as
the trainer starts) before the URL is called wrong."""
AFFINITY_SIZE = 4096
"""Prompts whose server the client remembers (their samples share its prefix cache)."""


class Fleet:
    """The servers at ``settings.urls`` and the one HTTP session that reaches them. ``key``:
    the config key that lists them (``remote.urls``, or ``eval.urls``), as messages name it."""

    def __init__(self, settings: RemoteConfig, stats: RemoteStats, *, key: str = "remote.urls") -> None:
        if not settings.urls:
            raise ValueError(f"engine=remote needs {key}: the base URLs of the servers (http://host:port)")
        self.settings, self.stats, self.key = settings, stats, key
        self.servers = [Server(url.rstrip("/")) for url in settings.urls]
        self._wire: Wire | None = None
        self._affinity: OrderedDict[tuple[int, ...], Server] = OrderedDict()

    def open(self) -> None:
        self._wire = Wire({"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {})

    async def close(self) -> None:
        if self._wire is not None:
            await self._wire.close()
            self._wire = None

    @property
    def is_open(self) -> bool:
        return self._wire is not None

    def live(self) -> Wire:
        if self._wire is None:
            raise EngineClosedError("the remote engine client is shut down")
        return self._wire

    @property
    def max_context(self) -> int:
        """The smallest context of the servers: a request must fit wherever it is re-issued."""
        return min((s.max_model_len for s in self.servers if s.max_model_len), default=0)

    def usable(self) -> list[Server]:
        return [s for s in self.servers if s.usable]

    def describe(self) -> dict[str, float | str]:
        """The fleet for a step's row (``remote/*``): servers up, losses so far and the servers
        lost (each URL, with ``×n`` when lost more than once), requests re-issued on another
        server and the tokens they carried."""
        return {"servers_up": sum(s.usable for s in self.servers), "servers_lost_total": self.stats.servers_lost,
                "reissued_requests_total": self.stats.reissued_requests,
                "reissued_tokens_total": self.stats.reissued_tokens,
                "lost_servers": ", ".join(url + (f" ×{n}" if n > 1 else "") for url, n in self.stats.lost.items())}

    # ---------------------------------------------------------------- routing
    def pick(self, key: tuple[int, ...]) -> Server:
        """The server for a prompt: the one its group went to while that one is up (its
        prefix cache), else the one with the fewest requests in flight."""
        usable = self.usable()
        if not usable:
            raise EngineClosedError("no engine server is left: " + "; ".join(
                f"{s.url} ({s.lost_reason or 'not connected'})" for s in self.servers)
                + ". Restart them (asyncrl serve-engine CONFIG, or vllm serve)")  # the run's failure says what next
        server = self._affinity.get(key)
        if server is None or not server.usable:
            server = min(usable, key=lambda s: s.in_flight)
            self._affinity[key] = server
            if len(self._affinity) > AFFINITY_SIZE:
                self._affinity.popitem(last=False)
        else:
            self._affinity.move_to_end(key)
        return server

    def forget_prefixes(self) -> None:
        """New weights: every server dropped its prefix cache, so no server is a prompt's own."""
        self._affinity.clear()

    # ---------------------------------------------------------------- control calls
    async def call(self, server: Server, method: str, path: str, body: dict[str, Any] | None = None, *,
                   timeout: float | None = None, knob: str = "remote.control_timeout_s",
                   missing_ok: bool = False, refused_5xx: bool = False) -> Any:
        """One control call under its deadline; ``ServerLost`` when the server does not
        answer (in time), ``ControlError`` when it refuses (``refused_5xx``: a 5xx but 503
        too, for calls whose failure vLLM reports as 500). Returns the JSON answer, or its
        text where it is not JSON (vLLM's LoRA routes)."""
        limit = self.settings.control_timeout_s if timeout is None else timeout
        start = time.monotonic()
        try:
            async with asyncio.timeout(limit):
                async with await self.live().request(method, f"{server.url}{path}", json=body) as response:
                    text = await response.text()
        except TimeoutError:
            raise ServerLost(f"{method} {path} did not answer within {limit:g} s ({knob})") from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            refused = isinstance(exc, (aiohttp.ClientConnectorError, ConnectionRefusedError))
            raise ServerLost(f"{method} {path} after {time.monotonic() - start:.1f} s: {_describe(exc)}",
                             refused=refused) from None
        if response.status == 404 and missing_ok:
            return None
        if response.status >= 500 and not (refused_5xx and response.status != 503):
            raise ServerLost(f"{method} {path} answered {response.status}: {_error_message(text)}")
        if response.status != 200:
            hint = (" (vllm serve needs VLLM_SERVER_DEV_MODE=1 for its RL routes)" if response.status == 404
                    else "")
            raise ControlError(f"engine server {server.url}: {method} {path} refused ({response.status}): "
                               f"{_error_message(text)}{hint}")
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            return text

    async def fan_out(self, method: str, path: str, timeout: float | None = None) -> None:
        """``method path`` on every usable server at once; one that does not answer is lost
        when its ``/health`` fails too, or when the call fails again."""
        async def one(server: Server) -> None:
            try:
                await self.call(server, method, path, timeout=timeout)
            except ServerLost as exc:
                if not await self.suspect(server, exc.reason):
                    try:
                        await self.call(server, method, path, timeout=timeout)
                    except ServerLost as again:
                        self.lose(server, f"{again.reason}, twice, though GET /health answers")

        await asyncio.gather(*[one(s) for s in self.usable()])

    async def wait_healthy(self, server: Server) -> None:
        """Until ``server`` answers ``GET /health``, at most ``remote.control_timeout_s``; an
        address where nothing accepts a connection for ``REFUSED_GRACE_S`` is a usage error
        (``ServersUnusable``, exit 2), said in one line: a wrong URL or a server not started."""
        start = time.monotonic()
        deadline = start + self.settings.control_timeout_s
        while True:
            try:
                await self.call(server, "GET", "/health", timeout=min(5.0, self.settings.control_timeout_s))
                return
            except ServerLost as exc:
                if exc.refused and time.monotonic() - start > min(REFUSED_GRACE_S, self.settings.control_timeout_s):
                    raise ServersUnusable(
                        f"{self.key}: nothing is listening at {server.url} ({exc.reason}). Start the server first "
                        "(asyncrl serve-engine CONFIG, or the vllm serve command in docs/vllm.md), then the trainer; "
                        "or correct the URL") from None
                if time.monotonic() > deadline:
                    raise EngineClosedError(
                        f"engine server {server.url} did not answer GET /health within "
                        f"{self.settings.control_timeout_s:g} s (remote.control_timeout_s): {exc.reason}. Start "
                        "it first (asyncrl serve-engine CONFIG, or vllm serve), then the trainer") from None
                await asyncio.sleep(0.5)

    async def read_card(self, server: Server) -> set[str]:
        """The base model's name and context; returns the LoRA adapters loaded there (the
        cards with a ``parent``, as vLLM lists them)."""
        cards = (await self.call(server, "GET", "/v1/models"))["data"]
        card = next((c for c in cards if not c.get("parent")), cards[0])
        server.model, server.root, server.owner = card["id"], card.get("root"), str(card.get("owned_by") or "")
        server.max_model_len = int(card.get("max_model_len") or 0)
        if server.max_model_len < 1:
            raise ControlError(f"engine server {server.url}: GET /v1/models gives no max_model_len for {server.model}")
        return {c["id"] for c in cards if c.get("parent")}

    # ---------------------------------------------------------------- losses and revivals
    async def suspect(self, server: Server, reason: str) -> bool:
        """A request to ``server`` failed (``reason``): the server is lost only when its
        ``GET /health`` fails too. One check per server at a time, shared by the requests
        that failed meanwhile (a burst's worth). True when it is lost (now or before)."""
        if not server.usable:
            return True
        if server.health_check is None or server.health_check.done():
            server.health_check = asyncio.ensure_future(self._health_problem(server))
        problem = await asyncio.shield(server.health_check)
        if problem is None:
            self.stats.suspected += 1
            return False
        self.lose(server, f"{reason}; then {problem}")
        return True

    async def _health_problem(self, server: Server) -> str | None:
        """None when ``server`` answers ``GET /health``, else why not (``GET /health …``)."""
        try:
            await self.call(server, "GET", "/health", timeout=min(5.0, self.settings.control_timeout_s))
        except ServerLost as exc:
            return exc.reason
        except ControlError as exc:
            return str(exc).removeprefix(f"engine server {server.url}: ")
        return None

    def lose(self, server: Server, reason: str) -> bool:
        """Leave ``server`` out (said once per loss); True when it was in until now."""
        if not server.usable:
            return False
        server.usable, server.lost_reason = False, reason
        self.stats.servers_lost += 1
        self.stats.lost[server.url] = self.stats.lost.get(server.url, 0) + 1
        left = [s.url for s in self.usable()]
        print(f"asyncrl: engine server {server.url} lost ({reason}); its requests go to "
              + (", ".join(left) if left else "no other: none is left"), file=sys.stderr, flush=True)
        return True

    async def watch_lost(self, revive: Callable[[Server], Awaitable[None]], closed: Callable[[], bool]) -> None:
        """Poll lost servers' ``/health`` every ``remote.health_interval_s``; one that answers is
        handed to ``revive`` (which brings it to the current weights, version and pause state)."""
        while not closed():
            await asyncio.sleep(self.settings.health_interval_s)
            for server in [s for s in self.servers if not s.usable and s.revivable]:
                try:
                    await self.call(server, "GET", "/health", timeout=min(5.0, self.settings.control_timeout_s))
                except ServerLost:
                    continue  # still down
                try:
                    await revive(server)
                except ServerLost:
                    continue
                except Exception as exc:  # it answers but cannot be brought back: said, tried again later
                    print(f"asyncrl: engine server {server.url} answers /health but could not be brought back: "
                          f"{_describe(exc)}", file=sys.stderr, flush=True)
