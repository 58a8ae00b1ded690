"""Sampling clients on one built-in engine (``asyncrl/engine/torch_engine.py``): each sampler
is pinned to the adapters of one checkpoint (or to the base model), and the engine holds one
set of weights at a time, so it takes turns.

The turn rule (:class:`EngineSampler`): requests for the weights loaded now run together
(continuous batching); a request for other weights waits until none is in flight, then the
engine loads them (an :class:`~asyncrl.engine.protocol.AdapterUpdate`, merged onto the engine's
base copy, ``asyncrl/engine/adapters.py``) and runs. While a request for other weights waits,
new requests for the loaded ones wait too, so no sampler starves. A sampler of an older
checkpoint thus keeps sampling *its* weights while training goes on: its adapters were copied
when it was saved (``TrainingRun.adapters``), never read from the live model.

Why every update covers every layer any checkpoint adapted: the engine merges W_base + s·B·A
for the layers an update names and leaves the others as they are, so a checkpoint adapting
fewer layers than the last one loaded would inherit the rest. Layers it lacks are sent as
zero adapters (W_base itself).

Stop sequences (``SamplingParams.stop``): token ids and strings that are one token end a
sequence on the engine between two steps; longer strings are found in the decoded text when
the sequence is done, and the tokens past the one that completes the string are dropped (the
sequence then cost up to ``max_tokens`` of decoding).

Two promises to the clients sharing the engine:

- **Checked at the door** (:meth:`EngineSampler.check`, called before a request is queued): a
  token id the embedding cannot index, an empty prompt, one that leaves no room in the context,
  sampling settings the engine refuses — each a :class:`UserError` naming the culprit, so
  nothing a client sends can reach the engine thread and end it (an id past the vocabulary
  raises ``IndexError`` there, which ends the thread and every request on it).
- **A failure fails one request**: should the engine's thread die all the same (an error the
  door does not foresee), every request it held is retried once, *alone*, on a fresh engine
  (:meth:`EngineSampler.sample`): the requests batched with the culprit are served, and the
  culprit, failing again with nothing beside it, fails by itself, the engine restarted once more.
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.algorithms import token_logprobs
from asyncrl.config import RolloutConfig
from asyncrl.engine.factory import torch_engine
from asyncrl.engine.protocol import AdapterUpdate, EngineClosedError, LayerAdapter, PromptTooLongError
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.tinker.futures import UserError
from asyncrl.tinker.wire import SampledRow, stop_tokens
from asyncrl.types import Completion, SamplingParams


MAX_SAMPLES = 1024
"""Samples one request may ask for: they all join the engine's batch at once (16 of its default
64-row batches), and the engine is every client's."""


@dataclass(frozen=True)
class SampleCall:
    """One ``asample`` as this server serves it."""

    prompt: list[int]
    num_samples: int
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: object
    prompt_logprobs: bool


@dataclass(frozen=True)
class EngineRequest:
    """A :class:`SampleCall` checked at the door (:meth:`EngineSampler.check`): what the engine runs."""

    prompt: list[int]
    params: list[SamplingParams]  # one a sample
    stop_texts: tuple[str, ...]  # stop strings longer than one token, matched in the decoded text
    prompt_logprobs: bool


@dataclass(frozen=True)
class _Alone:
    """The turn key of a request retried after the engine died under it: no other request
    shares it, so the retry runs with nothing beside it (on the weights of ``key``)."""

    key: Hashable
    number: int


class _EngineDied(Exception):
    """The engine ``engine`` ended under a request (``error``, the engine's own)."""

    def __init__(self, engine: TorchEngine, error: EngineClosedError) -> None:
        super().__init__(str(error))
        self.engine, self.error = engine, error


class EngineSampler:
    """The engine shared by every sampling client (see the module's turn rule)."""

    def __init__(self, base: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, seed: int = 0,
                 rollout: RolloutConfig | None = None, dtype: str | None = None) -> None:
        """``rollout``: the config's engine settings (batch rows, KV cache, capture, group
        prefill); ``dtype``: the engine's weights' (the config's ``rollout.dtype``, else the model's)."""
        self._base, self._seed = base, seed
        self._rollout, self._dtype = rollout or RolloutConfig(), dtype
        self.engine = self._build()
        self.vocab = int(base.get_input_embeddings().num_embeddings)
        """Token ids the engine's embedding indexes: 0 to ``vocab`` − 1."""
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.eos: tuple[int, ...] = () if eos is None else (eos,)
        self._cond = asyncio.Condition()
        self._loaded: Hashable = None  # the key of the weights the engine holds; None: the base
        self._active = 0  # requests running on them
        self._waiting: Counter[Hashable] = Counter()
        self._layers: dict[str, tuple[int, int]] = {}  # every layer any update adapted: (out, in)
        self._version = 0
        self._retries = 0  # numbers the _Alone keys
        self._closing = False

    def _build(self) -> TorchEngine:
        """A fresh engine on a copy of the base, from the one factory (``engine/factory.torch_engine``)."""
        return torch_engine(copy.deepcopy(self._base), self._rollout, seed=self._seed, dtype=self._dtype)

    async def shutdown(self) -> None:
        self._closing = True
        await self.engine.shutdown()

    def check(self, call: SampleCall) -> EngineRequest:
        """``call`` as the engine will run it, or a :class:`UserError` naming what in it the
        engine cannot run: called at the door, before the request is queued."""
        prompt, vocab, context = call.prompt, self.vocab, self.engine.max_positions
        if not prompt:
            raise UserError("the prompt is empty: sampling and compute_logprobs need at least one token")
        bad = [(i, t) for i, t in enumerate(prompt) if not 0 <= t < vocab]
        if bad:
            (position, token), more = bad[0], (f"; {len(bad)} of the prompt's {len(prompt)} tokens are outside it"
                                         if len(bad) > 1 else "")
            raise UserError(f"prompt position {position} holds token id {token}, outside this model's vocabulary of "
                            f"{vocab} (ids 0 to {vocab - 1}){more}")
        room = context - len(prompt)
        if room < 1:
            raise UserError(str(PromptTooLongError(len(prompt), context)))
        if not 1 <= call.num_samples <= MAX_SAMPLES:
            raise UserError(f"num_samples={call.num_samples}; this server draws 1 to {MAX_SAMPLES} a request "
                            "(they run together on the one engine every client shares: send more requests)")
        if call.max_tokens is not None and call.max_tokens < 1:
            raise UserError(f"sampling_params.max_tokens={call.max_tokens}; at least 1 (None: up to the context)")
        ids, texts = stop_tokens(call.stop, lambda s: self.tokenizer.encode(s, add_special_tokens=False), self.eos)
        try:
            params = [SamplingParams(max_tokens=min(call.max_tokens or room, room), temperature=call.temperature,
                                     top_p=call.top_p, top_k=max(call.top_k, 0), stop_token_ids=ids,
                                     seed=None if call.seed is None else (call.seed + i) % 2**63)
                      for i in range(call.num_samples)]
        except ValueError as exc:  # the engine's own bounds (temperature >= 0, top_p in (0, 1], ...)
            raise UserError(f"sampling_params: {exc}") from None
        return EngineRequest(prompt, params, texts, call.prompt_logprobs)

    async def sample(self, key: Hashable, update: AdapterUpdate | None, request: EngineRequest
                     ) -> tuple[list[SampledRow], list[float] | None]:
        """``request`` (:meth:`check`'s) on the weights ``key`` names (``update`` its adapters;
        ``None``: the base). Should the engine die under it, once more alone on a fresh engine
        (the module's second promise); failing there too, it fails by itself."""
        try:
            return await self._turn(key, update, request)
        except _EngineDied as died:
            await self._replace(died.engine)
            if self._closing:
                raise died.error from None
        self._retries += 1
        try:
            return await self._turn(_Alone(key, self._retries), update, request)
        except _EngineDied as died:
            await self._replace(died.engine)
            if self._closing:
                raise died.error from None
            raise RuntimeError(f"the engine failed on this request run alone on a fresh engine ({died.error}); the "
                               "engine was restarted and the other requests go on") from None

    async def _turn(self, key: Hashable, update: AdapterUpdate | None, request: EngineRequest
                    ) -> tuple[list[SampledRow], list[float] | None]:
        engine = await self._acquire(key, update)
        try:
            done: list[Completion] = await asyncio.gather(*(engine.generate(request.prompt, p)
                                                            for p in request.params))
            prompt_lps = await engine.call_between_steps(lambda: self._prompt_logprobs(engine, request.prompt)) \
                if request.prompt_logprobs else None
        except EngineClosedError as exc:
            raise _EngineDied(engine, exc) from None
        finally:
            await self._release()
        return [self._row(c, request.stop_texts) for c in done], prompt_lps

    async def _replace(self, dead: TorchEngine) -> None:
        """A fresh engine for ``dead`` (once, whoever of its requests comes first), holding the
        base weights; not while the sampler shuts down."""
        async with self._cond:
            if self.engine is dead and not self._closing:
                await dead.shutdown()  # its thread has ended: this joins it
                self.engine = await asyncio.to_thread(self._build)
                self._loaded = None

    def _row(self, completion: Completion, texts: tuple[str, ...]) -> SampledRow:
        tokens, logprobs = list(completion.token_ids), list(completion.logprobs)
        stopped = completion.finish_reason == "stop"
        if texts:
            for end in range(1, len(tokens) + 1):  # the first token whose text completes a stop string
                if any(t in self.tokenizer.decode(tokens[:end]) for t in texts):
                    tokens, logprobs, stopped = tokens[:end], logprobs[:end], True
                    break
        return SampledRow(tokens, logprobs, stopped)

    @staticmethod
    def _prompt_logprobs(engine: TorchEngine, prompt: list[int]) -> list[float]:
        """log p(prompt_t | prompt_<t) under the loaded weights, NaN at t = 0 (nothing precedes)."""
        with torch.no_grad():
            ids = torch.tensor([prompt], device=engine.device)
            lps = token_logprobs(engine.model(input_ids=ids).logits[0, :-1], ids[0, 1:])  # (T-1,)
        return [float("nan"), *lps.tolist()]

    async def _acquire(self, key: Hashable, update: AdapterUpdate | None) -> TorchEngine:
        """A turn on the weights ``key`` names: the engine to run it on (the one holding them)."""
        async with self._cond:
            self._waiting[key] += 1
            try:
                while not (self._active == 0 or (self._loaded == key and self._others_wait(key) == 0)):
                    await self._cond.wait()
            finally:
                self._waiting[key] -= 1
                if not self._waiting[key]:
                    del self._waiting[key]
            engine = self.engine
            if self._loaded != key:
                self._version += 1
                try:
                    await engine.update_weights(self._covering(update), self._version)
                except EngineClosedError as exc:
                    self._cond.notify_all()  # no turn taken: the next waiter may go
                    raise _EngineDied(engine, exc) from None
                self._loaded = key
            self._active += 1
            return engine

    async def _release(self) -> None:
        async with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def _others_wait(self, key: Hashable) -> int:
        return sum(n for k, n in self._waiting.items() if k != key)

    def _covering(self, update: AdapterUpdate | None) -> AdapterUpdate:
        """``update`` plus a zero adapter for every layer some earlier update adapted and it
        does not (see the module docstring); the base is all zero adapters."""
        layers = dict(update.layers) if update is not None else {}
        for name, layer in layers.items():
            self._layers.setdefault(name, tuple(layer.b.shape[:1]) + tuple(layer.a.shape[1:]))  # (out, in)
        for name, (out, inp) in self._layers.items():
            if name not in layers:
                layers[name] = LayerAdapter(torch.zeros(1, inp), torch.zeros(out, 1), 0.0)
        return AdapterUpdate(layers, rank=update.rank if update else 1, alpha=update.alpha if update else 1.0)
