"""``asyncrl bench gateway``: what the OpenAI-compatible gateway costs over calling the
engine directly — same model, prompts, sampling and engine, in one run.

Three paths to the same ``TorchEngine``, all on one event loop, as in a rollout worker:

- ``direct``: ``LLMClient.chat`` in process, a fresh client per request (one per episode);
- ``sdk``: the official ``openai`` SDK, one shared ``AsyncOpenAI`` client, to ``/v1``;
- ``session``: one ``gateway.session`` per request, the shared client rebased onto it with
  ``with_options(base_url=...)``, the call recorded into the request's ``LLMClient`` —
  what training does.

Throughput: ``requests`` chat calls, at most ``concurrency`` in flight, requests/s per
path. Latency: ``latency_calls`` calls one after another; the added latency of a prompt
is its gateway time minus its direct time (each the median over ``repeats``). Runs are
interleaved (the order rotates each repeat), so drifts in machine load hit all paths.

Every call is greedy and ignores end-of-sequence, so each generates exactly
``max_tokens`` tokens on every path, whatever the batch it lands in: the engine does the
same work, and the bench checks the token counts agree. The engine thread gets
``engine_threads`` torch threads; on a 2-core CPU one leaves the other core to the event
loop (two contend with the loop: docs/design.md, "Measurements behind choices in the code").
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from openai import AsyncOpenAI
from pydantic import Field
from transformers import PreTrainedTokenizerBase

from asyncrl.bench.progress import phase
from asyncrl.rollout.client import LLMClient, Message
from asyncrl.config import ModelConfig, RolloutConfig, Section, apply_overrides, validate
from asyncrl.engine import TorchEngine
from asyncrl.engine.factory import torch_engine
from asyncrl.rollout.gateway import Gateway, get_format
from asyncrl.policy import load_policy
from asyncrl.tasks import load_tasks
from asyncrl.types import SamplingParams

PATHS = ("direct", "sdk", "session")
Call = Callable[[list[Message]], Awaitable[int]]  # one chat call; returns the tokens generated


class GatewayBenchSettings(Section):
    model_path: str = "models/countdown-tiny"
    num_prompts: int = Field(64, ge=1)
    """Countdown validation prompts, cycled through by the requests."""
    requests: int = Field(256, ge=1)
    concurrency: int = Field(64, ge=1)
    latency_calls: int = Field(32, ge=1)
    max_tokens: int = Field(24, ge=1)
    max_batch_size: int = Field(64, ge=1)
    engine_threads: int = Field(1, ge=1)
    repeats: int = Field(5, ge=1)
    seed: int = 0


class _Paths:
    """The three ways to make one chat call, each returning its completion's token count."""

    def __init__(self, engine: TorchEngine, tokenizer: PreTrainedTokenizerBase, gateway: Gateway,
                 sdk: AsyncOpenAI, sampling: SamplingParams) -> None:
        self.engine, self.tokenizer, self.gateway, self.sdk, self.sampling = engine, tokenizer, gateway, sdk, sampling

    def call(self, path: str) -> Call:
        return {"direct": self.direct, "sdk": self.via_sdk, "session": self.via_session}[path]

    async def direct(self, messages: list[Message]) -> int:
        return len((await LLMClient(self.engine, self.tokenizer, self.sampling).chat(messages)).token_ids)

    async def via_sdk(self, messages: list[Message], sdk: AsyncOpenAI | None = None) -> int:
        reply = await (sdk or self.sdk).chat.completions.create(
            model=self.gateway.model_name, messages=messages, temperature=0, max_tokens=self.sampling.max_tokens)
        return reply.usage.completion_tokens

    async def via_session(self, messages: list[Message]) -> int:
        llm = LLMClient(self.engine, self.tokenizer, self.sampling)
        async with self.gateway.session(llm) as base_url:
            n = await self.via_sdk(messages, self.sdk.with_options(base_url=base_url))
        recorded = sum(len(t.response_ids) for t in llm.trajectories)
        if recorded != n:
            raise RuntimeError(f"session recorded {recorded} tokens, its reply reported {n}")
        return n


async def _throughput(call: Call, prompts: list[list[Message]], concurrency: int) -> tuple[float, int]:
    """Seconds for all ``prompts`` with at most ``concurrency`` in flight, and tokens generated."""
    gate = asyncio.Semaphore(concurrency)

    async def one(messages: list[Message]) -> int:
        async with gate:
            return await call(messages)

    start = time.perf_counter()
    tokens = await asyncio.gather(*[one(m) for m in prompts])
    return time.perf_counter() - start, sum(tokens)


def _rotated(repeat: int) -> tuple[str, ...]:
    """The paths in this repeat's order: each goes first once every len(PATHS) repeats."""
    k = repeat % len(PATHS)
    return PATHS[k:] + PATHS[:k]


def _check_same(where: str, tokens: dict[str, int]) -> None:
    if len(set(tokens.values())) != 1:
        raise RuntimeError(f"{where}: the paths generated different token counts {tokens}; the comparison is void")


async def _throughput_phase(s: GatewayBenchSettings, paths: _Paths, chats: list[list[Message]]) -> dict[str, Any]:
    requests = [chats[i % len(chats)] for i in range(s.requests)]
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    tokens: dict[str, int] = {}
    with phase("gateway", f"throughput, {s.requests} requests, {s.concurrency} in flight",
               total=s.repeats * len(PATHS)) as progress:
        for r in range(s.repeats):
            for path in _rotated(r):
                elapsed, tokens[path] = await _throughput(paths.call(path), requests, s.concurrency)
                times[path].append(elapsed)
                progress.advance()  # between timed runs
            _check_same(f"throughput, repeat {r + 1}", tokens)
        per_s = {p: s.requests / statistics.median(times[p]) for p in PATHS}
        progress.figure = ", ".join(f"{p} {per_s[p]:,.1f} req/s" for p in PATHS)
    return {"requests_per_s": per_s, "runs_s": times, "tokens": tokens}


async def _latency_phase(s: GatewayBenchSettings, paths: _Paths, chats: list[list[Message]]) -> dict[str, Any]:
    singles = [chats[i % len(chats)] for i in range(s.latency_calls)]
    latency: dict[str, list[list[float]]] = {p: [[] for _ in singles] for p in PATHS}  # [prompt][repeat] s
    tokens = {p: 0 for p in PATHS}
    with phase("gateway", f"latency, {s.latency_calls} sequential calls",
               total=s.repeats * len(singles), unit="call") as progress:
        for r in range(s.repeats):
            for i, messages in enumerate(singles):
                call_tokens = {}
                for path in _rotated(r):
                    start = time.perf_counter()
                    call_tokens[path] = await paths.call(path)(messages)
                    latency[path][i].append(time.perf_counter() - start)
                    tokens[path] += call_tokens[path]
                _check_same(f"latency, call {i + 1} of repeat {r + 1}", call_tokens)
                progress.advance()
        ms = {p: [1e3 * statistics.median(runs) for runs in latency[p]] for p in PATHS}  # per prompt
        added = {p: [g - d for g, d in zip(ms[p], ms["direct"])] for p in ("sdk", "session")}
        progress.figure = (f"direct {statistics.mean(ms['direct']):.1f} ms, " +
                           ", ".join(f"{p} {statistics.mean(added[p]):+.1f} ms" for p in added))
    return {"ms": {p: {"mean": statistics.mean(ms[p]), "median": statistics.median(ms[p])} for p in PATHS},
            "added_ms": {p: {"mean": statistics.mean(v), "median": statistics.median(v)} for p, v in added.items()},
            "tokens": tokens}


async def _measure(s: GatewayBenchSettings, model: Any, tokenizer: PreTrainedTokenizerBase,
                   chats: list[list[Message]]) -> dict[str, Any]:
    # no stop tokens: every call runs to max_tokens, so all paths do identical engine work
    sampling = SamplingParams(max_tokens=s.max_tokens, temperature=0)
    engine = torch_engine(model, RolloutConfig(max_batch_size=s.max_batch_size), seed=s.seed,
                          num_threads=s.engine_threads)
    gateway = Gateway(tokenizer, get_format("hermes"), model_name=s.model_path, engine=engine, sampling=sampling)
    sdk: AsyncOpenAI | None = None
    try:
        base_url = await gateway.start()
        sdk = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        paths = _Paths(engine, tokenizer, gateway, sdk, sampling)
        with phase("gateway", "warm-up"):  # the engine's first batches, the SDK's connections
            for path in PATHS:
                await _throughput(paths.call(path), chats[:s.concurrency], s.concurrency)
        throughput = await _throughput_phase(s, paths, chats)
        latency = await _latency_phase(s, paths, chats)
    finally:
        if sdk is not None:
            await sdk.close()
        await gateway.stop()
        await engine.shutdown()
    per_s = throughput["requests_per_s"]
    return {
        "requests_per_s": per_s,
        "throughput_runs_s": throughput["runs_s"],  # each repeat's seconds, per path
        "ratio_sdk_vs_direct": per_s["sdk"] / per_s["direct"],
        "ratio_session_vs_direct": per_s["session"] / per_s["direct"],
        "added_latency_ms": latency["added_ms"]["sdk"],
        "added_latency_ms_session": latency["added_ms"]["session"],
        "latency_ms": latency["ms"],
        # per path: one throughput run's tokens, and all latency calls' (every repeat)
        "tokens": {"throughput_run": throughput["tokens"], "latency_calls": latency["tokens"]},
    }


def run_gateway_bench(overrides: list[str]) -> dict[str, Any]:
    s = validate(GatewayBenchSettings, apply_overrides({}, overrides))
    model, tokenizer = load_policy(ModelConfig(path=s.model_path))
    tasks = load_tasks("countdown", seed=s.seed, num_train=0, num_validation=s.num_prompts).validation
    chats = [[{"role": "user", "content": t.prompt}] for t in tasks]
    result = {"settings": s.model_dump(), "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
              **asyncio.run(_measure(s, model, tokenizer, chats))}
    rps, lat = result["requests_per_s"], result["latency_ms"]
    added = {"direct": None, "sdk": result["added_latency_ms"], "session": result["added_latency_ms_session"]}
    print(f"{'path':8s} {'requests/s':>10s} {'vs direct':>9s} {'median ms':>10s} {'added ms mean':>13s} "
          f"{'added ms median':>15s}")
    for p in PATHS:
        extra = f"{added[p]['mean']:13.1f} {added[p]['median']:15.1f}" if added[p] else f"{'-':>13s} {'-':>15s}"
        print(f"{p:8s} {rps[p]:10.1f} {rps[p] / rps['direct']:9.2f} {lat[p]['median']:10.1f} {extra}")
    t = result["tokens"]
    print(f"tokens generated, per path: {t['throughput_run']} in each throughput run, {t['latency_calls']} in "
          f"the latency calls; latency ms = median over the prompts of each prompt's median of {s.repeats}")
    return result
