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
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.engine.protocol import AdapterUpdate, LayerAdapter, PromptTooLongError
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.tinker.futures import UserError
from asyncrl.tinker.wire import SampledRow, stop_tokens
from asyncrl.types import Completion, SamplingParams


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


class EngineSampler:
    """The engine shared by every sampling client (see the module's turn rule)."""

    def __init__(self, base: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, seed: int = 0) -> None:
        self.engine = TorchEngine(copy.deepcopy(base), seed=seed)
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.eos: tuple[int, ...] = () if eos is None else (eos,)
        self._cond = asyncio.Condition()
        self._loaded: Hashable = None  # the key of the weights the engine holds; None: the base
        self._active = 0  # requests running on them
        self._waiting: Counter[Hashable] = Counter()
        self._layers: dict[str, tuple[int, int]] = {}  # every layer any update adapted: (out, in)
        self._version = 0

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    async def sample(self, key: Hashable, update: AdapterUpdate | None, call: SampleCall
                     ) -> tuple[list[SampledRow], list[float] | None]:
        """``call`` on the weights ``key`` names (``update`` its adapters; ``None``: the base)."""
        if not call.prompt:
            raise UserError("the prompt is empty")
        if call.num_samples < 1:
            raise UserError(f"num_samples={call.num_samples}; at least 1")
        ids, texts = stop_tokens(call.stop, lambda s: self.tokenizer.encode(s, add_special_tokens=False), self.eos)
        room = self.engine.max_positions - len(call.prompt)
        if room < 1:
            raise UserError(str(PromptTooLongError(len(call.prompt), self.engine.max_positions)))
        params = [SamplingParams(max_tokens=min(call.max_tokens or room, room), temperature=call.temperature,
                                 top_p=call.top_p, top_k=max(call.top_k, 0), stop_token_ids=ids,
                                 seed=None if call.seed is None else (call.seed + i) % 2**63)
                  for i in range(call.num_samples)]
        await self._acquire(key, update)
        try:
            done: list[Completion] = await asyncio.gather(*(self.engine.generate(call.prompt, p) for p in params))
            prompt_lps = await self.engine.call_between_steps(lambda: self._prompt_logprobs(call.prompt)) \
                if call.prompt_logprobs else None
        finally:
            await self._release()
        return [self._row(c, texts) for c in done], prompt_lps

    def _row(self, completion: Completion, texts: tuple[str, ...]) -> SampledRow:
        tokens, logprobs = list(completion.token_ids), list(completion.logprobs)
        stopped = completion.finish_reason == "stop"
        if texts:
            for end in range(1, len(tokens) + 1):  # the first token whose text completes a stop string
                if any(t in self.tokenizer.decode(tokens[:end]) for t in texts):
                    tokens, logprobs, stopped = tokens[:end], logprobs[:end], True
                    break
        return SampledRow(tokens, logprobs, stopped)

    def _prompt_logprobs(self, prompt: list[int]) -> list[float]:
        """log p(prompt_t | prompt_<t) under the loaded weights, NaN at t = 0 (nothing precedes)."""
        with torch.no_grad():
            ids = torch.tensor([prompt], device=self.engine.device)
            logits = self.engine.model(input_ids=ids).logits[0, :-1].float()  # (T-1, V)
            lps = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        return [float("nan"), *lps.tolist()]

    async def _acquire(self, key: Hashable, update: AdapterUpdate | None) -> None:
        async with self._cond:
            self._waiting[key] += 1
            try:
                while not (self._active == 0 or (self._loaded == key and self._others_wait(key) == 0)):
                    await self._cond.wait()
            finally:
                self._waiting[key] -= 1
            if self._loaded != key:
                self._version += 1
                await self.engine.update_weights(self._covering(update), self._version)
                self._loaded = key
            self._active += 1

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
