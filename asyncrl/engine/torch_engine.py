"""The built-in rollout engine: continuous batching over any Hugging Face causal LM.

Why our own decode loop: on the 2-core CPU, transformers' continuous-batching manager ran
at ~1/3 of ``model.generate`` (docs/design.md), while a plain loop over ``model.forward`` with
a ``DynamicCache`` matches ``generate`` and lets sequences join and leave between steps.

Layout of the running batch: rows are left-padded to one cache length T; a 2-D attention
mask hides the padding and explicit position ids keep each row's positions contiguous.
Newcomers are prefilled together, then their cache is left-padded and concatenated to the
batch; a finished row is dropped with an index-select. Newcomers with the same prompt (the
n samples of a GRPO group) share one prefill (``group_prefill``, see ``_prefill``). All
model work happens on one engine thread, so asyncio callers never block and the learner can
run beside it (torch kernels release the GIL).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from asyncrl.engine.protocol import EngineClosedError, PauseMode, PromptTooLongError
from asyncrl.engine.sampling import RowParams, sample_tokens
from asyncrl.heap import HeapTrimmer
from asyncrl.threads import settle_threadsafe
from asyncrl.types import Completion, FinishReason, SamplingParams


@dataclass(eq=False)
class _Request:
    id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future[Completion]
    loop: asyncio.AbstractEventLoop
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False


@dataclass
class _Batch:
    """The running rows. The last sampled token of each row is not in the cache yet."""

    requests: list[_Request]
    cache: DynamicCache
    attention_mask: torch.Tensor  # (B, T) 1 = real token in the cache
    last_tokens: torch.Tensor  # (B,)
    positions: torch.Tensor  # (B,) position id of last_tokens
    rows: RowParams


@dataclass
class _Prefill:
    """Prefilled prompts: per layer (keys, values) of shape (rows, heads, T, head_dim), each
    row left-padded to T, and each row's last-position logits (rows, vocab)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor


@dataclass
class EngineStats:
    steps: int = 0
    prefills: int = 0  # prefill steps (each admits one or more newcomers)
    prefill_rows: int = 0  # prompts run through the model by those steps
    prefill_reused: int = 0  # newcomers that forked another's prefill instead
    tokens: int = 0
    busy_s: float = 0.0


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class TorchEngine:
    """Continuous-batching engine over a transformers causal LM (CPU or CUDA).

    ``group_prefill``: prefill a prompt once for all the requests admitted with it, and keep
    the last ``prefix_cache_size`` prefilled prompts (on the current weights) for requests
    that come later; ``False`` prefills every request on its own (the reference)."""

    def __init__(
        self, model: PreTrainedModel, *, max_batch_size: int = 64, seed: int = 0, version: int = 0,
        num_threads: int | None = None, group_prefill: bool = True, prefix_cache_size: int = 64,
    ) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.stats = EngineStats()
        self.num_threads = num_threads  # torch's thread count is per OS thread: set on ours
        self.group_prefill = group_prefill
        self.prefix_cache_size = prefix_cache_size if group_prefill else 0
        self._prefixes: OrderedDict[tuple[int, ...], _Prefill] = OrderedDict()  # one row each, no padding
        self._version = version
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._ids = itertools.count()
        self._waiting: deque[_Request] = deque()
        self._batch: _Batch | None = None
        self._paused = False
        self._admitting = True  # False while pause("wait") drains the running batch
        self._drain_waiters: list[tuple[asyncio.Future[None], asyncio.AbstractEventLoop]] = []
        self._closed = False
        self._error: BaseException | None = None
        self._inbox: list[tuple[Callable[[], None], asyncio.Future[Any], asyncio.AbstractEventLoop]] = []
        self._live: set[_Request] = set()  # submitted and not yet finished, wherever they are
        self._heap = HeapTrimmer()  # each decode step reallocates the KV cache: see asyncrl/heap.py
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="asyncrl-torch-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    # ----------------------------------------------------------------- async verbs
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        if len(prompt_ids) >= self.max_positions:  # position ids past the table would kill the decode thread
            raise PromptTooLongError(len(prompt_ids), self.max_positions)
        loop = asyncio.get_running_loop()
        req = _Request(next(self._ids), list(prompt_ids), sampling, loop.create_future(), loop)
        self._post(lambda: self._waiting.append(req), req.future, loop, request=req)
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.future.cancel()  # nobody will read it: settling it later must not warn
            with contextlib.suppress(EngineClosedError):
                self._post(lambda: self._drop(req), req.future, loop)
            raise

    async def pause(self, mode: PauseMode = "keep") -> None:
        if mode == "wait":
            loop = asyncio.get_running_loop()
            drained: asyncio.Future[None] = loop.create_future()

            def drain() -> None:
                self._admitting = False
                self._drain_waiters.append((drained, loop))

            self._post(drain, drained, loop)
            await drained

        def pause() -> None:
            self._paused, self._admitting = True, True
            if mode == "abort" and self._batch is not None:
                for req in self._batch.requests:
                    self._finish(req, "abort")
                self._batch = None

        await self._call(pause)

    async def resume(self) -> None:
        await self._call(lambda: setattr(self, "_paused", False))

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        params = dict(self.model.named_parameters())
        unknown = sorted(set(weights) - set(params))
        if unknown:
            raise KeyError(f"update_weights got names the model does not have: {unknown[:5]}")

        def load() -> None:
            with torch.no_grad():
                for name, tensor in weights.items():
                    params[name].copy_(tensor, non_blocking=True)
            self._version = version
            self._prefixes.clear()  # prefilled on the old weights: never fork them again

        await self._call(load)

    async def shutdown(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        await asyncio.to_thread(self._thread.join)

    # ------------------------------------------------------------ thread plumbing
    def _post(self, fn: Callable[[], None], future: asyncio.Future[Any], loop: asyncio.AbstractEventLoop,
              request: _Request | None = None) -> None:
        """Run ``fn`` on the engine thread between two steps; if the engine stops first,
        ``future`` gets the error instead."""
        with self._wake:
            if self._error is not None:
                raise _closed_error(self._error)
            if self._closed:
                raise EngineClosedError("the engine is shut down")
            if request is not None:
                self._live.add(request)
            self._inbox.append((fn, future, loop))
            self._wake.notify()

    async def _call(self, fn: Callable[[], Any]) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def run() -> None:
            try:
                fn()
            except Exception as exc:  # handed to the caller, not swallowed
                settle_threadsafe(loop, done, None, exc)
                return
            settle_threadsafe(loop, done, None, None)

        self._post(run, done, loop)
        await done

    def _run(self) -> None:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        try:
            while True:
                with self._wake:
                    while not (self._closed or self._inbox or (not self._paused and self._has_work())):
                        self._wake.wait()
                    if self._closed:
                        break
                    inbox, self._inbox = self._inbox, []
                for fn, _, _ in inbox:
                    fn()
                if not self._paused and self._has_work():
                    self._step()
                    self._heap.trim()
                if self._batch is None and self._drain_waiters:
                    for future, loop in self._drain_waiters:
                        settle_threadsafe(loop, future, None, None)
                    self._drain_waiters.clear()
        except BaseException as exc:
            self._error = exc
        finally:
            with self._wake:
                self._closed = True
                error = _closed_error(self._error or EngineClosedError("the engine is shut down"))
                pending = [(r.future, r.loop) for r in self._live] + [(f, lp) for _, f, lp in self._inbox]
                pending += self._drain_waiters
                self._live.clear()
                self._inbox.clear()
            for future, loop in pending:
                settle_threadsafe(loop, future, None, error)
            self._waiting.clear()
            self._batch = None
            self._prefixes.clear()

    def _has_work(self) -> bool:
        return (self._admitting and bool(self._waiting)) or self._batch is not None

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def _step(self) -> None:
        """Schedule, run, postprocess: prefill newcomers if there is room, else decode."""
        start = time.perf_counter()
        room = self.max_batch_size - (len(self._batch.requests) if self._batch else 0)
        if self._admitting and self._waiting and room > 0:
            newcomers = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            self._prefill(newcomers)
            self.stats.prefills += 1
        else:
            self._decode()
            self.stats.steps += 1
        self.stats.busy_s += time.perf_counter() - start

    def _prefill(self, reqs: list[_Request]) -> None:
        """Prefill newcomers, sample their first tokens and add them to the running batch.

        Group prefill: the newcomers are keyed by their prompt ids; each distinct prompt not
        in the prefix cache is run through the model once, and every newcomer gets its own
        copy of its prompt's KV rows (an index-select) and samples its first token from the
        shared last-position logits with its own parameters and seed. A prompt's prefill
        depends on its ids and the weights only, so a fork equals a prefill of its own up
        to float noise, and after the copy the rows are independent: one fork finishing,
        aborting or being cancelled leaves the others alone. Off, every request is its own
        key and nothing is cached or copied: the plain batched prefill.
        """
        keys: list[Any] = [tuple(r.prompt_ids) if self.group_prefill else r.id for r in reqs]
        unique = list(dict.fromkeys(keys))
        fresh = [k for k in unique if k not in self._prefixes]
        prompts = {k: r.prompt_ids for k, r in zip(keys, reqs)}
        sources: list[_Prefill] = []
        if fresh:
            block, cache = self._forward_prompts([prompts[k] for k in fresh])
            sources.append(block)
        row = {k: i for i, k in enumerate(fresh)}
        for k in unique:  # cache hits: one row each, after the fresh block
            if k not in row:
                row[k] = len(row)
                sources.append(self._prefixes[k])
                self._prefixes.move_to_end(k)
        length = max(len(p) for p in prompts.values())
        if len(fresh) == len(reqs):  # nothing shared: the forward's own tensors, as they are
            layers, logits = block.layers, block.logits
        else:
            index = torch.tensor([row[k] for k in keys], device=self.device)

            def fork(parts: list[torch.Tensor]) -> torch.Tensor:  # one row per request, in request order
                return (parts[0] if len(parts) == 1 else torch.cat(parts)).index_select(0, index)

            layers = [tuple(fork([_left_pad(s.layers[i][j], length, -2) for s in sources]) for j in (0, 1))
                      for i in range(len(sources[0].layers))]
            logits = fork([s.logits for s in sources])
            if fresh:
                for layer, (k, v) in zip(cache.layers, layers):
                    layer.keys, layer.values = k, v
            else:
                cache = DynamicCache(layers, config=self.model.config)
        if fresh and self.prefix_cache_size:
            self._remember(fresh, [len(prompts[k]) for k in fresh], block)
        self.stats.prefill_rows += len(fresh)
        self.stats.prefill_reused += len(reqs) - len(fresh)

        mask = torch.tensor([[0] * (length - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in reqs],
                            device=self.device)
        positions = torch.tensor([len(r.prompt_ids) for r in reqs], device=self.device)  # of the next token
        rows = RowParams([r.sampling for r in reqs], self.device)
        tokens, logprobs = sample_tokens(logits, rows, self._generator, positions)
        batch = _Batch(reqs, cache, mask, tokens, positions, rows)
        self._batch = batch if self._batch is None else self._merge(self._batch, batch)
        self._postprocess(tokens, logprobs, reqs)

    def _forward_prompts(self, prompts: list[list[int]]) -> tuple[_Prefill, DynamicCache]:
        length = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (length - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return _Prefill(layers, out.logits[:, -1]), out.past_key_values

    def _remember(self, keys: list[Any], lengths: list[int], block: _Prefill) -> None:
        """Keep the fresh prompts' rows (copied, unpadded: the block itself is freed) for
        requests with the same prompt admitted later: a group split over admissions by a full
        batch or by thread timing. Bounded (oldest use leaves first) and cleared on every
        weight update, so a fork never mixes weights."""
        for i, (key, n) in enumerate(zip(keys, lengths)):
            layers = [(k[i:i + 1, :, -n:].clone(), v[i:i + 1, :, -n:].clone()) for k, v in block.layers]
            self._prefixes[key] = _Prefill(layers, block.logits[i:i + 1].clone())
        while len(self._prefixes) > self.prefix_cache_size:
            self._prefixes.popitem(last=False)

    def _decode(self) -> None:
        b = self._batch
        assert b is not None
        mask = torch.cat([b.attention_mask, b.attention_mask.new_ones(len(b.requests), 1)], dim=1)
        out = self.model(input_ids=b.last_tokens[:, None], attention_mask=mask, position_ids=b.positions[:, None],
                         past_key_values=b.cache, use_cache=True)
        tokens, logprobs = sample_tokens(out.logits[:, -1], b.rows, self._generator, b.positions + 1)
        b.attention_mask, b.last_tokens, b.positions = mask, tokens, b.positions + 1
        self._postprocess(tokens, logprobs, b.requests)

    def _postprocess(self, tokens: torch.Tensor, logprobs: torch.Tensor, reqs: list[_Request]) -> None:
        token_list, logprob_list = tokens.tolist(), logprobs.tolist()  # one device sync per step
        version = self._version  # <- every token is stamped with the weights that sampled it
        self.stats.tokens += len(token_list)
        for req, token, logprob in zip(reqs, token_list, logprob_list):
            req.token_ids.append(token)
            req.logprobs.append(logprob)
            req.versions.append(version)
            if token in req.sampling.stop_token_ids:
                self._finish(req, "stop")
            elif (len(req.token_ids) >= req.sampling.max_tokens
                  or len(req.prompt_ids) + len(req.token_ids) >= self.max_positions):
                self._finish(req, "length")
        self._evict_finished()

    # -------------------------------------------------------- batch bookkeeping
    def _merge(self, a: _Batch, b: _Batch) -> _Batch:
        length = max(a.attention_mask.shape[1], b.attention_mask.shape[1])
        for la, lb in zip(a.cache.layers, b.cache.layers):
            la.keys = torch.cat([_left_pad(la.keys, length, -2), _left_pad(lb.keys, length, -2)])
            la.values = torch.cat([_left_pad(la.values, length, -2), _left_pad(lb.values, length, -2)])
        requests = a.requests + b.requests
        return _Batch(
            requests, a.cache,
            torch.cat([_left_pad(a.attention_mask, length, 1), _left_pad(b.attention_mask, length, 1)]),
            torch.cat([a.last_tokens, b.last_tokens]), torch.cat([a.positions, b.positions]),
            RowParams([r.sampling for r in requests], self.device),
        )

    def _finish(self, req: _Request, reason: FinishReason) -> None:
        req.done = True
        self._live.discard(req)
        completion = Completion(req.token_ids, req.logprobs, req.versions, reason)
        settle_threadsafe(req.loop, req.future, completion, None)

    def _drop(self, req: _Request) -> None:
        """A caller gave up on ``req`` (its task was cancelled)."""
        self._live.discard(req)
        if req in self._waiting:
            self._waiting.remove(req)
        elif self._batch is not None and req in self._batch.requests:
            req.done = True
            self._evict_finished()

    def _evict_finished(self) -> None:
        b = self._batch
        if b is None:
            return
        keep = [i for i, r in enumerate(b.requests) if not r.done]
        if len(keep) == len(b.requests):
            return
        if not keep:
            self._batch = None
            return
        index = torch.tensor(keep, device=self.device)
        mask = b.attention_mask.index_select(0, index)
        first = int((mask.sum(0) > 0).nonzero()[0])  # drop columns that are padding in every row
        for layer in b.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        requests = [b.requests[i] for i in keep]
        self._batch = _Batch(requests, b.cache, mask[:, first:], b.last_tokens.index_select(0, index),
                             b.positions.index_select(0, index), RowParams([r.sampling for r in requests], self.device))


def _closed_error(reason: BaseException) -> BaseException:
    if isinstance(reason, EngineClosedError):
        return reason
    err = EngineClosedError(f"the engine thread failed: {reason!r}")
    err.__cause__ = reason
    return err
