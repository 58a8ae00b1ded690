"""The retrieval service: BM25, dense or hybrid search (``dense.py``) over HTTP (aiohttp, like the gateway), batched.

``POST /search {"query": str, "k": int}`` → ``{"results": [{"id", "score", "text"}, ...]}``
best first (``k`` defaults to 5, at most :data:`MAX_K`); ``GET /health``. A bad request is
refused with 400 and ``{"error": {"message", "type", "param", "code"}}``, the server going on.

Batching: one worker task takes every query waiting, waits ``max_wait_s`` for more when
fewer than ``max_batch`` are there, and scores them together on a thread of its own (the
event loop keeps accepting meanwhile); the next batch gathers while one is scored.
Scoring costs the same per query batched or not (``index.py``), so what batching saves
is per-query overhead around it: the hand-off of each query between the event loop's
thread and the scoring thread, which trade the GIL every time (``python -m
asyncrl.tools.retrieval.bench batching`` measures it; docs/results.md has the figures).
Waiting for more (``max_wait_s``) makes batches larger but nothing faster: the default is
0, which adds no latency to a lone query.

``latency_s`` stands in for a remote service: each request sleeps that long (on the
event loop, so others go on) before its query joins a batch; ``latency`` (a
:class:`Latency`) instead draws each request's sleep from a lognormal of a given median
and 99th percentile, the heavy tail a remote search API has.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator

from asyncrl.json_api import Refused, error_response, listen, read_body
from asyncrl.tools.retrieval.index import SearchIndex
from asyncrl.tools.retrieval.types import Hit

logger = logging.getLogger(__name__)

MAX_K = 100
_GRACE_S = 1.0  # what stop() gives requests in flight before cancelling them


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    query: str
    k: int = Field(5, ge=1, le=MAX_K)

    @field_validator("query")
    @classmethod
    def _not_blank(cls, query: str) -> str:
        if not query.strip():
            raise ValueError("must not be blank")
        return query


Z_99 = 2.3263478740408408  # the standard normal's 99th percentile


def lognormal_sigma(median_s: float, p99_s: float) -> float:
    """σ of the lognormal whose median is ``median_s`` and 99th percentile ``p99_s``:
    p99 = median · exp(σ · z₀.₉₉), so σ = ln(p99 / median) / z₀.₉₉ (0 when they are equal)."""
    if not 0 < median_s <= p99_s:
        raise ValueError(f"latency: need 0 < median {median_s} <= p99 {p99_s}")
    return math.log(p99_s / median_s) / Z_99


class Latency:
    """A request's added sleep: lognormal with ``median_s`` and ``p99_s``, seeded, so that a
    schedule comparison meets the same sequence of delays in every run (in request order)."""

    def __init__(self, median_s: float, p99_s: float, *, seed: int = 0) -> None:
        self.median_s, self.p99_s = median_s, p99_s
        self.sigma = lognormal_sigma(median_s, p99_s)
        self._rng = random.Random(seed)

    def sample(self) -> float:
        return self._rng.lognormvariate(math.log(self.median_s), self.sigma)


@dataclass
class _Pending:
    query: str
    k: int
    future: asyncio.Future[list[Hit]]


class RetrievalService:
    def __init__(self, index: SearchIndex, *, latency_s: float = 0.0, max_batch: int = 64,
                 max_wait_s: float = 0.0, latency: Latency | None = None) -> None:
        """``latency_s``: added to every request (``latency``, when given, draws it instead);
        ``max_batch``: queries scored together at most; ``max_wait_s``: how long a batch
        with room waits for more queries."""
        if latency_s < 0 or max_wait_s < 0 or max_batch < 1:
            raise ValueError(f"latency_s {latency_s} and max_wait_s {max_wait_s} must be >= 0, "
                             f"max_batch {max_batch} >= 1")
        self.index, self.latency_s, self.max_batch, self.max_wait_s = index, latency_s, max_batch, max_wait_s
        self.latency = latency
        self.counts = {"requests": 0, "refused": 0, "queries": 0, "batches": 0}
        self.base_url = ""
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._scorer: ThreadPoolExecutor | None = None
        self._runner: web.AppRunner | None = None

    # -- lifecycle ------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen (``port`` 0: a free one); returns the base URL."""
        self._queue = asyncio.Queue()
        self._scorer = ThreadPoolExecutor(1, thread_name_prefix="retrieval-scorer")
        self._worker = asyncio.create_task(self._batches(), name="retrieval-batches")
        app = web.Application()
        app.router.add_post("/search", self._search)
        app.router.add_get("/health", self._health)
        try:
            self._runner, self.base_url = await listen(app, host, port, shutdown_timeout=_GRACE_S)
        except OSError:
            await self.stop()
            raise
        return self.base_url

    async def stop(self) -> None:
        """Stop listening; queries still waiting fail. Safe to call twice."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        while self._queue is not None and not self._queue.empty():
            self._queue.get_nowait().future.cancel()
        if self._scorer is not None:
            self._scorer.shutdown(wait=True)
            self._scorer = None

    # -- handlers -------------------------------------------------------------
    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "documents": len(self.index), **self.counts})

    async def _search(self, request: web.Request) -> web.Response:
        self.counts["requests"] += 1
        try:
            body = await read_body(request, SearchRequest)
            if delay := (self.latency.sample() if self.latency is not None else self.latency_s):
                await asyncio.sleep(delay)
            hits = await self._submit(body.query, body.k)
        except Refused as exc:
            self.counts["refused"] += 1
            return error_response(exc)
        except Exception as exc:  # a bug of ours: the client gets a 500 in our shape, the log the traceback
            logger.exception("retrieval: %s %s failed", request.method, request.path)
            return error_response(Refused(500, f"{type(exc).__name__}: {exc}"))
        return web.json_response({"results": hits})

    # -- batching ---------------------------------------------------------------
    async def _submit(self, query: str, k: int) -> list[Hit]:
        if self._queue is None or self._worker is None:
            raise Refused(503, "the service has stopped")
        future: asyncio.Future[list[Hit]] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(query, k, future))
        return await future

    async def _batches(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            if self.max_wait_s and self._queue.qsize() < self.max_batch - 1:
                await asyncio.sleep(self.max_wait_s)
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            batch = [p for p in batch if not p.future.done()]  # a request cancelled while it waited
            if not batch:
                continue
            self.counts["batches"] += 1
            self.counts["queries"] += len(batch)
            try:
                results = await loop.run_in_executor(self._scorer, self.index.search_batch,
                                                     [p.query for p in batch], max(p.k for p in batch))
            except asyncio.CancelledError:  # stopped mid-batch
                for p in batch:
                    p.future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 (a bug of ours: each request of the batch answers 500)
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, hits in zip(batch, results, strict=True):
                if not p.future.done():
                    p.future.set_result(hits[:p.k])
