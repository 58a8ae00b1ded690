"""A frozen model reached by URL: one client shape for every model a run asks but never trains
(a judge, a teacher, a refine service), on an OpenAI-compatible server — vLLM's, or asyncrl's own.

What every caller gets from it, so no caller writes these again:

- **a bound**: at most ``max_concurrency`` requests in flight to the model, however many
  episodes ask at once (the rest wait their turn, and that wait is not counted against the
  call's deadline);
- **a deadline per try** (``timeout_s``) and ``retries`` further tries after a failure, with a
  short backoff; a 4xx other than 408/429 is not retried (asking again will not help);
- **a failure that names the model**: its role, URL, route, the tries and the seconds waited —
  a judge that is down fails the episode (which the workflow retries, then counts), never a
  silent 0;
- **its cost, counted**: calls, failures and seconds, which the run's rows report.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import aiohttp

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class FrozenModelError(RuntimeError):
    """A frozen model did not answer usably: the message names the model, the call and the wait."""


@dataclass
class FrozenModelStats:
    """Counts since the client was made: what a step row reports as ``<role>/calls`` etc."""

    calls: int = 0
    failures: int = 0
    seconds: float = 0.0

    def snapshot(self) -> dict[str, float]:
        return {"calls": self.calls, "failures": self.failures, "seconds": round(self.seconds, 4)}


_OPEN: weakref.WeakValueDictionary[int, FrozenModel] = weakref.WeakValueDictionary()
"""Clients with a session open: a judge lives inside the reward function a workflow holds,
which has no shutdown of its own, so the rollout worker closes them all when it stops."""


async def close_open_clients() -> None:
    """Close every frozen model's session opened in this process (the rollout worker's
    shutdown: otherwise aiohttp warns of an unclosed session at exit)."""
    for model in list(_OPEN.values()):
        await model.close()


@dataclass
class FrozenModel:
    """One served model by URL. ``url`` is the server's base (``http://host:port``, with or
    without ``/v1``); ``model`` the served name (``None``: the server's first, from ``/v1/models``)."""

    role: str
    url: str
    model: str | None = None
    api_key: str | None = None
    max_concurrency: int = 8
    timeout_s: float = 60.0
    retries: int = 2
    backoff_s: float = 0.5
    stats: FrozenModelStats = field(default_factory=FrozenModelStats)

    def __post_init__(self) -> None:
        base = self.url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self._slots: asyncio.Semaphore | None = None
        self._session: aiohttp.ClientSession | None = None

    def __str__(self) -> str:
        return f"the {self.role} at {self.url}"

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        _OPEN.pop(id(self), None)

    def _http(self) -> aiohttp.ClientSession:
        # made on first use, on the loop that uses it (a client may be built before the run's loop starts)
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(headers=headers)
            _OPEN[id(self)] = self
            self._slots = asyncio.Semaphore(self.max_concurrency)
        return self._session

    async def post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``route`` (under ``/v1``) within the bound, the deadline and the retries."""
        return await self._post(f"{self.base}{route}", body)

    async def post_root(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """As :meth:`post`, for a route beside ``/v1`` (vLLM's ``/tokenize``)."""
        return await self._post(f"{self.base.removesuffix('/v1')}{route}", body)

    async def _post(self, address: str, body: dict[str, Any]) -> dict[str, Any]:
        session = self._http()
        assert self._slots is not None
        async with self._slots:
            started = time.monotonic()
            last = "no try was made"
            for attempt in range(self.retries + 1):
                if attempt:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    async with asyncio.timeout(self.timeout_s):
                        async with session.post(address, json=body) as reply:
                            text = await reply.text()
                            if reply.status == 200:
                                self.stats.calls += 1
                                self.stats.seconds += time.monotonic() - started
                                return _json(text, self, address)
                            last = f"HTTP {reply.status}: {text[:300]}"
                            if reply.status not in RETRYABLE_STATUS:
                                break
                except TimeoutError:
                    last = f"no answer within {self.timeout_s:g} s"
                except aiohttp.ClientError as exc:
                    last = f"{type(exc).__name__}: {exc}"
            self.stats.calls += 1
            self.stats.failures += 1
            waited = time.monotonic() - started
            self.stats.seconds += waited
            raise FrozenModelError(f"{self}: POST {address} failed after {attempt + 1} tries and "
                                   f"{waited:.1f} s ({last})")

    async def served_model(self) -> str:
        """The model name to ask for: ``model``, else the first the server lists."""
        if self.model is None:
            session = self._http()
            try:
                async with asyncio.timeout(self.timeout_s), session.get(f"{self.base}/models") as reply:
                    listed = (await reply.json()).get("data") or []
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                raise FrozenModelError(f"{self}: GET {self.base}/models failed ({exc!r}); is the server up?") from None
            if not listed:
                raise FrozenModelError(f"{self}: GET {self.base}/models lists no model; set the model's name")
            self.model = listed[0]["id"]
        return self.model

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> str:
        """The assistant's text for ``messages`` (``/v1/chat/completions``)."""
        body = {"model": await self.served_model(), "messages": messages, **params}
        reply = await self.post("/chat/completions", body)
        try:
            return reply["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise FrozenModelError(f"{self}: /v1/chat/completions answered without a message: {str(reply)[:300]}")

    async def token_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token_t | tokens_<t) for every token after the first of each sequence, in one
        batched ``/v1/completions`` call with vLLM's ``prompt_logprobs`` (the token ids as the
        prompt, one token generated and ignored). ``asyncrl serve-engine`` answers the same."""
        body = {"model": await self.served_model(), "prompt": sequences, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0}
        reply = await self.post("/completions", body)
        choices = sorted(reply.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(sequences):
            raise FrozenModelError(f"{self}: asked for the logprobs of {len(sequences)} sequences, got "
                                   f"{len(choices)} answers")
        return [_prompt_logprobs(self, choice, ids) for choice, ids in zip(choices, sequences, strict=True)]


def _prompt_logprobs(model: FrozenModel, choice: dict[str, Any], ids: list[int]) -> list[float]:
    """vLLM's ``prompt_logprobs``: per position None (the first) or ``{token_id: {"logprob": x, ...}}``
    holding at least the prompt's own token."""
    rows = choice.get("prompt_logprobs")
    if not isinstance(rows, list) or len(rows) != len(ids):
        raise FrozenModelError(f"{model}: no prompt_logprobs for a {len(ids)}-token sequence (does the server "
                               "take vLLM's `prompt_logprobs`? asyncrl serve-engine and vLLM do)")
    out = []
    for position, (row, token) in enumerate(zip(rows[1:], ids[1:], strict=True), start=1):
        entry = (row or {}).get(str(token))
        if entry is None:
            raise FrozenModelError(f"{model}: prompt_logprobs at position {position} lack the prompt's token {token}")
        out.append(float(entry["logprob"] if isinstance(entry, dict) else entry))
    return out


def _json(text: str, model: FrozenModel, address: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        raise FrozenModelError(f"{model}: {address} answered 200 with a body that is not JSON: {text[:200]!r}") \
            from None
    if not isinstance(data, dict):
        raise FrozenModelError(f"{model}: {address} answered 200 with {type(data).__name__}, not an object")
    return data
