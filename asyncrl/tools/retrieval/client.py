"""The agent's side of the retrieval service.

``search`` raises :class:`RetrievalError` once its attempts are spent; ``search_tool_message``
never raises for a failure of the service (down, slow, refusing the query, answering
nonsense): it returns ``"search failed: <reason>"``, which the agent hands to the model as
the tool's result, so a failed tool call is part of the episode, not the end of it.

What is retried: a connection error, a timeout, a 5xx. What is not: a 400 (the same
query would be refused again; the model should read why). Each attempt has its own
``timeout_s``; attempt n + 1 waits ``backoff_s * 2**n`` first.

One client per event loop, closed when done (``async with RetrievalClient(url) as c``):
it keeps an aiohttp session, so the connections are reused across searches.

Several endpoints (``RetrievalClient([url1, url2, ...])``, replicas of one index): each
attempt goes to the least-loaded endpoint — the fewest searches in flight from this
process (an :class:`EndpointPool`, shared by every client of the same endpoints) — that
is not marked dead and has not failed in this search. An endpoint whose attempt fails
transiently is marked dead for ``dead_s`` (a warning names it and why) and skipped by
every client until then, so the retry goes to another; when every endpoint has failed,
the error names each with its reason. One endpoint behaves as before: its retries go to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Self

import aiohttp

from asyncrl.tools.retrieval.types import Hit

logger = logging.getLogger(__name__)


class EndpointPool:
    """Searches in flight per endpoint and the endpoints marked dead, for one process: every
    client of the same endpoints shares one (:meth:`shared`), so "least loaded" counts the
    process's episodes together, not one episode's."""

    _shared: ClassVar[dict[tuple[str, ...], EndpointPool]] = {}

    def __init__(self, urls: Sequence[str], *, dead_s: float = 10.0) -> None:
        if not urls:
            raise ValueError("a retrieval client needs at least one endpoint URL")
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.dead_s = dead_s
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.used = dict.fromkeys(self.urls, 0)
        self.dead_until = dict.fromkeys(self.urls, 0.0)

    @classmethod
    def shared(cls, urls: Sequence[str]) -> EndpointPool:
        key = tuple(u.rstrip("/") for u in urls)
        if key not in cls._shared:
            cls._shared[key] = cls(key)
        return cls._shared[key]

    def pick(self, failed: set[str]) -> str:
        """The least-loaded live endpoint not in ``failed``; else the least-loaded not in
        ``failed`` (all marked dead: one may be back); else the least-loaded of all."""
        now = time.monotonic()
        for candidates in ([u for u in self.urls if u not in failed and self.dead_until[u] <= now],
                           [u for u in self.urls if u not in failed], list(self.urls)):
            if candidates:
                return min(candidates, key=lambda u: (self.in_flight[u], self.used[u]))
        raise AssertionError("unreachable: a pool has at least one endpoint")

    def mark_dead(self, url: str, reason: str) -> None:
        if len(self.urls) > 1:  # with one endpoint there is nothing to skip to
            if self.dead_until[url] <= time.monotonic():
                logger.warning("retrieval endpoint %s skipped for %g s: %s", url, self.dead_s, reason)
            self.dead_until[url] = time.monotonic() + self.dead_s

    def dead(self) -> list[str]:
        now = time.monotonic()
        return [u for u in self.urls if self.dead_until[u] > now]


class RetrievalError(Exception):
    """The search did not succeed; the message says why, in words fit for the model."""


class RetrievalClient:
    def __init__(self, base_url: str | Sequence[str], *, timeout_s: float = 5.0, retries: int = 2,
                 backoff_s: float = 0.05, pool: EndpointPool | None = None) -> None:
        """``base_url``: one endpoint or several (replicas); ``retries``: attempts after the
        first, for failures that may pass; ``pool``: the load and dead marks to share
        (default: the process's one for these endpoints)."""
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"timeout_s {timeout_s} must be > 0, retries {retries} and backoff_s {backoff_s} >= 0")
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.pool = pool or EndpointPool.shared(urls)
        self.base_url = self.pool.urls[0]
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def search(self, query: str, k: int = 5) -> list[Hit]:
        """The service's best ``k`` hits for ``query``, best first; raises :class:`RetrievalError`."""
        attempts = 1 + self.retries
        reasons: dict[str, str] = {}  # endpoint -> its last failure in this search
        for attempt in range(attempts):
            url = self.pool.pick(set(reasons))
            if attempt and url in reasons:  # retrying where it failed: give it time (a fresh endpoint needs none)
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            self.pool.in_flight[url] += 1
            self.pool.used[url] += 1
            try:
                return await self._post(url, query, k)
            except _Transient as exc:
                reasons[url] = str(exc)
                self.pool.mark_dead(url, str(exc))
            finally:
                self.pool.in_flight[url] -= 1
        reason = "; ".join(reasons.values())
        if len(self.pool.urls) > 1:
            reason = f"every endpoint tried failed: {reason}"
        raise RetrievalError(f"{reason} ({attempts} attempt{'s' * (attempts > 1)})")

    async def search_tool_message(self, query: str, k: int = 5, *, max_chars: int = 500) -> str:
        """The search as the tool result an agent shows its model: one line per hit
        (``[rank] id: text``, each text cut at ``max_chars``), ``no results``, or
        ``search failed: <reason>``. Never raises for the service's failures."""
        try:
            hits = await self.search(query, k)
        except RetrievalError as exc:
            return f"search failed: {exc}"
        return format_hits(hits, max_chars=max_chars)

    async def _post(self, base_url: str, query: str, k: int) -> list[Hit]:
        loop = asyncio.get_running_loop()
        if self._session is None:
            self._session, self._loop = aiohttp.ClientSession(), loop
        elif self._loop is not loop:  # aiohttp's session cannot move: a clear error, not "Event loop is closed"
            raise RuntimeError("a RetrievalClient belongs to the event loop that first used it: make one per loop")
        url = f"{base_url}/search"
        try:
            async with self._session.post(url, json={"query": query, "k": k},
                                          timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as response:
                status, text = response.status, await response.text()
        except TimeoutError:
            raise _Transient(f"no answer from {url} within {self.timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            raise _Transient(f"cannot reach {url}: {exc}") from None
        try:
            body = json.loads(text)
        except ValueError:  # a proxy's error page, another service
            body = None
        if status != 200:
            message = _error_message(body) or f"HTTP {status}"
            if status >= 500:
                raise _Transient(f"the service failed: {message}")
            raise RetrievalError(f"the request was refused: {message}")
        return _hits(body, url)


class _Transient(Exception):
    """A failure that may pass: worth another attempt."""


def format_hits(hits: list[Hit], *, max_chars: int = 500) -> str:
    if not hits:
        return "no results"
    return "\n".join(f"[{rank}] {hit['id']}: {_cut(hit['text'], max_chars)}" for rank, hit in enumerate(hits, 1))


def _cut(text: str, max_chars: int) -> str:
    text = " ".join(text.split())  # one line per hit
    return text if len(text) <= max_chars else text[:max_chars - 1] + "…"


def _error_message(body: Any) -> str | None:
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("message") if isinstance(error, dict) and isinstance(error.get("message"), str) else None


def _hits(body: Any, url: str) -> list[Hit]:
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list) or not all(
            isinstance(r, dict) and isinstance(r.get("id"), str) and isinstance(r.get("text"), str)
            and isinstance(r.get("score"), int | float) for r in results):
        raise RetrievalError(f"{url} answered without a list of results of id, score and text")
    return [Hit(id=r["id"], score=float(r["score"]), text=r["text"]) for r in results]
