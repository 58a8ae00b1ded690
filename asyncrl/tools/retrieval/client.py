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
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Self

import aiohttp

from asyncrl.tools.retrieval.types import Hit


class RetrievalError(Exception):
    """The search did not succeed; the message says why, in words fit for the model."""


class RetrievalClient:
    def __init__(self, base_url: str, *, timeout_s: float = 5.0, retries: int = 2, backoff_s: float = 0.05) -> None:
        """``retries``: attempts after the first, for failures that may pass."""
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"timeout_s {timeout_s} must be > 0, retries {retries} and backoff_s {backoff_s} >= 0")
        self.base_url = base_url.rstrip("/")
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
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return await self._post(query, k)
            except _Transient as exc:
                reason = str(exc)
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

    async def _post(self, query: str, k: int) -> list[Hit]:
        loop = asyncio.get_running_loop()
        if self._session is None:
            self._session, self._loop = aiohttp.ClientSession(), loop
        elif self._loop is not loop:  # aiohttp's session cannot move: a clear error, not "Event loop is closed"
            raise RuntimeError("a RetrievalClient belongs to the event loop that first used it: make one per loop")
        url = f"{self.base_url}/search"
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
