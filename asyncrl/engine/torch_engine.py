"""The built-in rollout engine: continuous batching over any Hugging Face causal LM.

Why our own decode loop: on the CPU, transformers' continuous-batching manager ran well
below ``model.generate`` (the figure is in docs/design.md), while a plain loop over
``model.forward`` with a ``DynamicCache`` matches ``generate`` and lets sequences join and
leave between steps.

Three parts, as in nano-vllm: ``scheduler.py`` decides (admit, decode, finish, abort) on
plain records; ``kv_batch.py`` holds the running batch's tensors and the surgery on them
(merge newcomers, evict finished rows, fork a group's shared prefill, the prefix cache);
this module is the shell: the asyncio-facing verbs, the engine thread, and a step that
reads schedule → run → postprocess. All model work happens on that one thread, so asyncio
callers never block and the learner can run beside it (torch kernels release the GIL).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar, cast

import torch
from transformers import DynamicCache, PreTrainedModel

from asyncrl.engine.adapters import AdapterMerger
from asyncrl.engine.hf_cache import filled_layers, forward_with_cache
from asyncrl.engine.kv_batch import KVBatch, Prefill, PrefixCache, fork_prefill, prompt_mask
from asyncrl.engine.protocol import (AdapterUpdate, EngineClosedError, PauseMode, PromptTooLongError, TokenSink,
                                     WeightUpdate, as_update)
from asyncrl.engine.sampling import RowParams, sample_tokens
from asyncrl.engine.scheduler import QueueState, ScheduledStep, Scheduler, Sequence
from asyncrl.engine.static_kv import StaticKV
from asyncrl.engine.step_capture import Capture, KVCache, decode_runner
from asyncrl.heap import HeapTrimmer
from asyncrl.policy import weights_dtype
from asyncrl.core_budget import ThreadBudget
from asyncrl.threads import settle_threadsafe
from asyncrl.types import Completion, SamplingParams
from asyncrl.config.engine_kinds import ENGINE_KINDS, EngineKind

T = TypeVar("T")


@dataclass(eq=False)
class _Request(Sequence):
    """A sequence with the caller waiting on it."""

    future: asyncio.Future[Completion] = field(kw_only=True)
    loop: asyncio.AbstractEventLoop = field(kw_only=True)
    on_tokens: TokenSink | None = field(default=None, kw_only=True)
    sent: float = field(default_factory=time.monotonic, kw_only=True)  # for queue_state's oldest wait


def _requests(sequences: list[Sequence]) -> list[_Request]:
    """The scheduler's sequences, as this engine submits them: each a :class:`_Request`."""
    return cast("list[_Request]", sequences)


@dataclass
class EngineStats:
    steps: int = 0
    prefills: int = 0  # prefill steps (each admits one or more newcomers)
    prefill_rows: int = 0  # prompts run through the model by those steps
    prefill_tokens: int = 0  # positions those prompts filled, padded to each step's longest
    decode_positions: int = 0  # cache positions decode steps attended over, padded (rows × longest)
    prefill_reused: int = 0  # newcomers that forked another's prefill instead
    tokens: int = 0
    busy_s: float = 0.0
    prefill_s: float = 0.0  # of busy_s, in prefill steps (the planner fits the two apart)

    def counts(self) -> dict[str, float]:
        """Every count above but ``busy_s`` (``RolloutEngineStats.counts``)."""
        return {name: value for name, value in vars(self).items() if name != "busy_s"}


class TorchEngine:
    """Continuous-batching engine over a transformers causal LM (CPU or CUDA).

    ``group_prefill``: prefill a prompt once for all the requests admitted with it, and keep
    the last ``prefix_cache_size`` prefilled prompts (on the current weights) for requests
    that come later; ``False`` prefills every request on its own (the reference).

    ``dtype`` (``rollout.dtype``): the engine casts ``model`` to it in place (the model is
    the engine's own from then on), and :meth:`update_weights` rounds each tensor it is sent
    to it as it copies, so a float32 learner can feed a bf16 engine. ``None``: as given.

    ``kv_cache``: ``"static"`` decodes from KV buffers allocated once (``static_kv.py``),
    ``"dynamic"`` from a ``DynamicCache`` grown by concatenation (``kv_batch.py``), ``"auto"``
    picks per device (``step_capture.STATIC_BY_DEFAULT``) where the model allows it.
    ``capture`` (static cache only): ``"graphs"`` replays the decode step from CUDA graphs
    (CUDA only), ``"compile"`` runs it through ``torch.compile``, ``"auto"``: graphs on CUDA.
    Either way a weight update copies into the parameters the captured step reads."""

    kind: ClassVar[EngineKind] = ENGINE_KINDS["torch"]  # what it can do: the kinds table's row

    def __init__(
        self, model: PreTrainedModel, *, max_batch_size: int = 64, seed: int = 0, version: int = 0,
        weight_noise: float = 0.0,  # a bench and test facility: see _perturb
        num_threads: int | None = None, group_prefill: bool = True, prefix_cache_size: int = 64,
        dtype: str | torch.dtype | None = None, thread_budget: ThreadBudget | None = None,
        kv_cache: KVCache = "auto", capture: Capture | Literal["auto"] = "auto",
    ) -> None:
        self.model = model.eval() if dtype is None else model.eval().to(weights_dtype(dtype))
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.stats = EngineStats()
        self.num_threads = num_threads  # torch's thread count is per OS thread: set on ours
        # the cores shared with the learner (rollout.thread_sharing: colocated): working before
        # each step, idle with nothing to decode, so each side takes every core while alone
        self.thread_budget = thread_budget
        self.group_prefill = group_prefill
        self.prefix_cache_size = prefix_cache_size if group_prefill else 0
        self._scheduler = Scheduler(max_batch_size, self.max_positions)
        self._decoder = decode_runner(self.model, max_batch_size, kv_cache, capture)  # None: the dynamic cache
        self._kv: KVBatch | StaticKV | None = None  # row i is self._scheduler.running[i]
        self._prefixes = PrefixCache(self.prefix_cache_size)
        self._version = version
        self._adapters = AdapterMerger()  # an AdapterUpdate's targeted layers: their base, merged here
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self.weight_noise = weight_noise
        self._noise = torch.Generator().manual_seed(seed)  # its own stream: sampling draws the same with or without
        self._perturb(dict(model.named_parameters()))
        self._ids = itertools.count()
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
    def max_context(self) -> int:
        """The model's context in tokens (prompt + completion): ``max_position_embeddings``,
        or 2**30 when the model sets none (the same number as ``max_positions``)."""
        return self.max_positions

    @property
    def kv_cache(self) -> str:
        """The decode path in use: ``"static"`` or ``"dynamic"``."""
        return "dynamic" if self._decoder is None else "static"

    @property
    def capture(self) -> str:
        """How the static decode step runs: ``"graphs"``, ``"compile"`` or ``"off"``."""
        return "off" if self._decoder is None else self._decoder.capture

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    def queue_state(self) -> QueueState:
        """How many requests wait for a row and run, and the oldest wait: for an episode's
        deadline error (``asyncrl/rollout/deadline.py``). Read from the caller's thread
        without stopping the engine, so a snapshot, not a consistent cut."""
        scheduler = self._scheduler
        try:
            oldest = time.monotonic() - scheduler.waiting[0].sent  # type: ignore[attr-defined]
        except IndexError:  # none waits (or the last was admitted meanwhile)
            oldest = 0.0
        return QueueState(len(scheduler.waiting), len(scheduler.running), oldest, scheduler.paused)

    # ----------------------------------------------------------------- async verbs
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       on_tokens: TokenSink | None = None) -> Completion:
        """``on_tokens``: each sampled token as the step that sampled it ends
        (``StreamingEngine``)."""
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        if len(prompt_ids) >= self.max_positions:  # position ids past the table would kill the decode thread
            raise PromptTooLongError(len(prompt_ids), self.max_positions)
        loop = asyncio.get_running_loop()
        req = _Request(next(self._ids), list(prompt_ids), sampling, future=loop.create_future(), loop=loop,
                       on_tokens=on_tokens)
        self._post(lambda: self._scheduler.add(req), req.future, loop, request=req)
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.future.cancel()  # nobody will read it: settling it later must not warn
            with contextlib.suppress(EngineClosedError):
                self._post(lambda: self._drop(req), req.future, loop)
            raise

    async def pause(self, mode: PauseMode = "keep") -> int | None:
        if mode == "wait":
            loop = asyncio.get_running_loop()
            drained: asyncio.Future[None] = loop.create_future()

            def drain() -> None:
                self._scheduler.stop_admitting()
                self._drain_waiters.append((drained, loop))

            self._post(drain, drained, loop)
            await drained

        def pause() -> int:
            self._scheduler.pause()
            if mode != "abort":
                return 0
            aborted = self._scheduler.abort_running()
            for req in _requests(aborted):
                self._settle(req)
            self._kv = None
            return len(aborted)

        return await self._call(pause)

    async def resume(self) -> None:
        await self._call(self._scheduler.resume)

    async def update_weights(self, update: WeightUpdate | Mapping[str, torch.Tensor], version: int) -> None:
        """:class:`FullWeights` are copied in; an :class:`AdapterUpdate` is merged into this
        engine's copy of the base off the engine's thread (``asyncrl/engine/adapters.py``),
        then loaded like any weights."""
        params = dict(self.model.named_parameters())
        update = as_update(update)
        if isinstance(update, AdapterUpdate):
            weights: Mapping[str, torch.Tensor] = await asyncio.to_thread(self._adapters.merge, update, params)
        else:
            weights = update.tensors
        unknown = sorted(set(weights) - set(params))
        if unknown:
            raise KeyError(f"update_weights got names the model does not have: {unknown[:5]}")

        def load() -> None:
            with torch.no_grad():
                for name, tensor in weights.items():
                    params[name].copy_(tensor, non_blocking=True)
            self._perturb({name: params[name] for name in weights})
            self._version = version
            self._prefixes.clear()  # prefilled on the old weights: never fork them again

        await self._call(load)

    def _perturb(self, params: Mapping[str, torch.Tensor]) -> None:
        """``weight_noise`` σ > 0 (``rollout.engine_weight_noise``, a bench and test facility):
        every tensor loaded becomes w · (1 + σ·ε), ε ~ N(0, 1) drawn afresh at each load, so
        the engine samples from a copy that differs from the learner's, as a GPU engine's
        bf16 weights and kernels make it differ: the training–inference mismatch, made
        reproducibly on CPU. σ = 0: the engine's weights are the learner's exactly."""
        if not self.weight_noise:
            return
        with torch.no_grad():
            for param in params.values():
                eps = torch.randn(param.shape, generator=self._noise).to(param.device, param.dtype)
                param.mul_(1 + self.weight_noise * eps)

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

    async def call_between_steps(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the engine's thread, before its next step: in ``sync`` the learner's
        calls run here, so that one OS thread (one OpenMP team) does all the computing."""
        return await self._call(fn)

    async def _call(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            if done.cancelled():  # the caller gave up while this waited (a client that hung up): skip the work
                return
            try:
                value = fn()
            except Exception as exc:  # handed to the caller, not swallowed
                settle_threadsafe(loop, done, None, exc)
                return
            settle_threadsafe(loop, done, value, None)

        self._post(run, done, loop)
        return await done

    def _run(self) -> None:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        scheduler = self._scheduler
        budget = self.thread_budget
        inbox_first = False
        try:
            while True:
                if budget is not None and not scheduler.has_work():
                    budget.idle("engine")
                with self._wake:
                    while not (self._closed or self._inbox or scheduler.has_work()):
                        self._wake.wait()
                    if self._closed:
                        break
                    inbox, self._inbox = self._inbox, []
                for fn, _, _ in inbox:
                    fn()
                if scheduler.has_work():
                    if budget is not None:
                        budget.working("engine")
                        # what was posted while it waited for a core (a weight sync's pause after a
                        # learner step, in turns) goes first; once, so newcomers cannot starve a step
                        if self._inbox and not inbox_first:
                            inbox_first = True
                            continue
                    inbox_first = False
                    self._step()
                    self._heap.trim()
                if not scheduler.running and self._drain_waiters:
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
            scheduler.clear()
            self._kv = None
            self._prefixes.clear()

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def _step(self) -> None:
        """Schedule, run, postprocess: prefill newcomers if there is room, else decode."""
        start = time.perf_counter()
        step = self._scheduler.schedule()
        if step.is_prefill:
            tokens, logprobs = self._run_prefill(step.sequences)
            self.stats.prefills += 1
        else:
            tokens, logprobs = self._run_decode()
            self.stats.steps += 1
        self._postprocess(step, tokens, logprobs)
        elapsed = time.perf_counter() - start
        self.stats.busy_s += elapsed
        if step.is_prefill:
            self.stats.prefill_s += elapsed

    def _postprocess(self, step: ScheduledStep, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        # the step's one host synchronisation: tokens and logprobs come back together
        both = torch.stack([tokens.double(), logprobs.double()]).cpu()  # float64 holds every token id exactly
        token_ids, logprob_values = both[0].long().tolist(), both[1].tolist()
        version = self._version  # <- every token is stamped with the weights that sampled it
        self.stats.tokens += len(token_ids)
        finished = self._scheduler.postprocess(step.sequences, token_ids, logprob_values, version)
        sinks: dict[asyncio.AbstractEventLoop, list[tuple[TokenSink, list[int]]]] = {}
        for req, token in zip(_requests(step.sequences), token_ids):
            if req.on_tokens is not None:
                sinks.setdefault(req.loop, []).append((req.on_tokens, [token]))
        for loop, calls in sinks.items():  # one wake-up per loop and step, not per request (every episode has a
            # sink: its deadline's); posted before the settle below, so the loop runs them first
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody listens
                loop.call_soon_threadsafe(_deliver, loop, calls)
        for req in _requests(finished):
            self._settle(req)
        self._evict_finished()

    # ------------------------------------------------------------ run: the model
    def _run_prefill(self, newcomers: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill newcomers, sample their first tokens and add their rows to the batch.

        Group prefill: the newcomers are keyed by their prompt ids; each distinct prompt not
        in the prefix cache is run through the model once, and every newcomer gets its own
        copy of its prompt's KV rows and samples its first token from the shared
        last-position logits with its own parameters and seed (``kv_batch.fork_prefill``).
        Off, every request is its own key and nothing is cached or copied: the plain
        batched prefill.
        """
        keys: list[Hashable] = [tuple(r.prompt_ids) if self.group_prefill else r.id for r in newcomers]
        prompts = {key: r.prompt_ids for key, r in zip(keys, newcomers)}
        fresh = [key for key in prompts if key not in self._prefixes]
        block, cache = self._forward_prompts([prompts[key] for key in fresh]) if fresh else (None, None)
        fresh_set = set(fresh)
        cached = {key: self._prefixes.take(key) for key in prompts if key not in fresh_set}
        length = max(len(p) for p in prompts.values())
        cache, logits = fork_prefill(keys, fresh, block, cache, cached, length, self.model.config)
        if block is not None:
            self._prefixes.remember(fresh, [len(prompts[key]) for key in fresh], block)
        self.stats.prefill_rows += len(fresh)
        self.stats.prefill_tokens += len(fresh) * max((len(prompts[key]) for key in fresh), default=0)
        self.stats.prefill_reused += len(newcomers) - len(fresh)

        lengths = [len(r.prompt_ids) for r in newcomers]
        mask = prompt_mask(lengths, length, self.device)
        positions = torch.tensor(lengths, device=self.device)  # of the next token
        params = [r.sampling for r in newcomers]
        rows = RowParams(params, self.device)
        tokens, logprobs = sample_tokens(logits, rows, self._generator, positions)
        joined = KVBatch(cache, mask, tokens, positions, params, rows)
        if self._decoder is not None:  # copied into the buffers allocated once
            static = self._decoder.kv if self._kv is not None else self._decoder.kv.reset()
            self._kv = static.merge(joined, lengths)
        else:
            self._kv = joined if self._kv is None else cast(KVBatch, self._kv).merge(joined)  # no decoder: a KVBatch
        return tokens, logprobs

    def _forward_prompts(self, prompts: list[list[int]]) -> tuple[Prefill, DynamicCache]:
        length = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (length - len(p)) + p for p in prompts], device=self.device)
        mask = prompt_mask([len(p) for p in prompts], length, self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = forward_with_cache(self.model, cache, input_ids=ids, attention_mask=mask, position_ids=positions,
                                 logits_to_keep=1)
        layers = [(layer.keys, layer.values) for layer in filled_layers(cache)]
        return Prefill(layers, out.logits[:, -1]), cache

    def _run_decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._kv
        assert kv is not None
        self.stats.decode_positions += len(kv) * kv.width
        # (rows, vocab); without a decoder the rows are a KVBatch
        logits = cast(KVBatch, kv).forward(self.model) if self._decoder is None else self._decoder()
        tokens, logprobs = sample_tokens(logits, kv.rows, self._generator, kv.positions + 1)  # on the device
        kv.advance(tokens)
        return tokens, logprobs

    # -------------------------------------------------------- finishing rows
    def _settle(self, req: _Request) -> None:
        self._live.discard(req)
        if req.finish_reason is None:
            raise RuntimeError("a request is settled before the scheduler finished it")
        completion = Completion(req.token_ids, req.logprobs, req.versions, req.finish_reason)
        settle_threadsafe(req.loop, req.future, completion, None)

    def _drop(self, req: _Request) -> None:
        """A caller gave up on ``req`` (its task was cancelled)."""
        self._live.discard(req)
        if self._scheduler.cancel(req):
            self._evict_finished()

    def _evict_finished(self) -> None:
        keep = self._scheduler.remove_finished()
        if self._kv is not None:
            self._kv = self._kv.keep_rows(keep)


def _deliver(loop: asyncio.AbstractEventLoop, calls: list[tuple[TokenSink, list[int]]]) -> None:
    """One step's tokens to their sinks, on the callers' loop; a sink that raises is
    reported as a callback's would be, and the others still get theirs."""
    for sink, ids in calls:
        try:
            sink(ids)
        except Exception as exc:
            loop.call_exception_handler({"message": "an on_tokens sink raised", "exception": exc})


def _closed_error(reason: BaseException) -> BaseException:
    if isinstance(reason, EngineClosedError):
        return reason
    err = EngineClosedError(f"the engine thread failed: {reason!r}")
    err.__cause__ = reason
    return err
