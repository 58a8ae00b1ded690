"""The rollout engine contract every implementation (built-in torch, vLLM) keeps.

Verbs follow vLLM's RL hooks: ``pause(mode)``, ``update_weights(update, version)``,
``resume()``. All are async: the orchestrator and many workflow tasks call them from one
event loop while the engine generates elsewhere (a thread, a process, another node).

What ``update_weights`` takes says what it is (:data:`WeightUpdate`): :class:`FullWeights`,
whole tensors under the model's own parameter names, or :class:`AdapterUpdate`, LoRA's A, B
and scale per targeted layer, which the engine merges onto its own base. The learner picks
one kind once per run (``asyncrl/learner/export.py``); an engine dispatches on the type.
A sharded learner gathers before it sends and merged LoRA sends the merged layers, so both
are :class:`FullWeights` (whole tensors; a subset of the names is a valid update): an
engine loads them the same way, and only adapters need an engine's own code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from asyncrl.config.engine_kinds import EngineKind, PauseMode
from asyncrl.types import Completion, SamplingParams

TokenSink = Callable[[list[int]], None]
"""Takes a request's newly sampled token ids, on the caller's event loop (streaming)."""


class EngineClosedError(RuntimeError):
    """The engine was shut down (or died) while a request was waiting on it."""


class PromptTooLongError(ValueError):
    """A prompt that leaves no room in the model's context for even one new token."""

    def __init__(self, prompt_tokens: int, max_context: int) -> None:
        super().__init__(f"the prompt has {prompt_tokens} tokens; the model's context holds {max_context}, "
                         "and at least one must be left to generate")
        self.prompt_tokens, self.max_context = prompt_tokens, max_context


@dataclass(frozen=True)
class FullWeights(Mapping[str, torch.Tensor]):
    """Whole tensors (never shards) under the model's own parameter names, read as a
    mapping: every parameter (full fine-tuning; a sharded learner's, gathered), or some of
    them (LoRA merged: each targeted layer's W + s·B·A; the rest is the base the engine
    already holds). An engine copies each into the parameter of that name."""

    tensors: Mapping[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class LayerAdapter:
    """One targeted layer's LoRA: ΔW = scale · B @ A. a: (r, in), b: (out, r);
    ``transposed``: the base stores the layer (in, out) (GPT-2's Conv1D), so ΔW is too."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    transposed: bool = False


@dataclass(frozen=True)
class AdapterUpdate:
    """LoRA adapters alone (``model.lora.sync``: ``adapters``, the default where the engine
    takes them): each targeted layer's :class:`LayerAdapter` under its base parameter's name
    (``model.layers.0.self_attn.q_proj.weight``); r × (in + out) numbers a layer instead of
    out × in. The engine merges W_base + scale · B @ A onto its own copy of the base
    (``asyncrl/engine/adapters.py``), every time from the base, never from a previous merge.
    ``rank`` and ``alpha`` are the run's ``model.lora`` (scale = alpha / rank), for an
    engine that loads adapters as a PEFT directory."""

    layers: Mapping[str, LayerAdapter]
    rank: int
    alpha: float

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (layer.a, layer.b))


WeightUpdate = FullWeights | AdapterUpdate
"""What ``RolloutEngine.update_weights`` takes: the learner's choice of what is sent."""


def as_update(update: WeightUpdate | Mapping[str, torch.Tensor]) -> WeightUpdate:
    """``update``, a plain name → tensor mapping read as :class:`FullWeights` (what callers
    passed before the update was typed)."""
    if isinstance(update, (FullWeights, AdapterUpdate)):
        return update
    if isinstance(update, Mapping):
        return FullWeights(update)
    raise TypeError(f"update_weights takes FullWeights or AdapterUpdate (asyncrl.engine.protocol), not "
                    f"{type(update).__name__}")


def flatten_update(update: WeightUpdate) -> tuple[Any, dict[str, torch.Tensor]]:
    """``update`` as (a small picklable header, flat name → tensor) for a transport that
    moves flat tensors (the collective's buckets, a shared-memory block);
    :func:`unflatten_update` is its inverse. The header says the kind, so nothing is read
    from the names."""
    if isinstance(update, FullWeights):
        return ("full",), dict(update.tensors)
    names = list(update.layers)
    header = ("adapters", update.rank, update.alpha,
              tuple((name, layer.scale, layer.transposed) for name, layer in update.layers.items()))
    tensors = {f"{i}.a": update.layers[name].a for i, name in enumerate(names)}
    tensors |= {f"{i}.b": update.layers[name].b for i, name in enumerate(names)}
    return header, tensors


def unflatten_update(header: Any, tensors: Mapping[str, torch.Tensor]) -> WeightUpdate:
    """The update :func:`flatten_update` made ``(header, tensors)`` of."""
    if header[0] == "full":
        return FullWeights(dict(tensors))
    _, rank, alpha, layers = header
    return AdapterUpdate({name: LayerAdapter(tensors[f"{i}.a"], tensors[f"{i}.b"], scale, transposed)
                          for i, (name, scale, transposed) in enumerate(layers)}, rank=rank, alpha=alpha)


class RolloutEngineStats(Protocol):
    """What the orchestrator reads from an engine (the idle ratios)."""

    @property
    def busy_s(self) -> float:
        """Seconds spent generating so far."""
        ...

    def counts(self) -> dict[str, float]:
        """What else it counts, by name (decode steps, prefills, tokens: what it knows of its
        own work; an engine elsewhere knows less)."""
        ...


class RolloutEngine(Protocol):
    kind: ClassVar[EngineKind]
    """What it can do: its row of the kinds table (``asyncrl/config/engine_kinds.py``)."""

    @property
    def version(self) -> int: ...

    @property
    def max_context(self) -> int:
        """The model's context in tokens: a prompt of this many tokens or more cannot be
        served (``PromptTooLongError``), and prompt + completion never exceed it. The gateway
        refuses a request that cannot fit before tokenizing it; ``serve-engine`` reports it as
        vLLM's ``max_model_len``."""
        ...

    @property
    def stats(self) -> RolloutEngineStats: ...

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        """Sample one completion. Cancelling the awaiting task aborts the request."""
        ...

    def queue_state(self) -> object | None:
        """A snapshot of the requests waiting for a row and running, for an episode's deadline
        error (``asyncrl/rollout/deadline.py``); None where the engine keeps its queue to
        itself (vLLM, servers)."""
        ...

    async def pause(self, mode: PauseMode = "keep") -> int | None:
        """Stop between two decode steps. ``keep``: in-flight sequences wait with their KV
        cache; ``abort``: they return now with finish reason ``abort`` and their partial
        tokens (the client resumes them); ``wait``: admit nothing new and return once the
        in-flight sequences have finished on the current weights. Returns how many running
        sequences ``abort`` ended, where the engine knows (None where it does not)."""
        ...

    async def resume(self) -> None: ...

    async def update_weights(self, update: WeightUpdate, version: int) -> None:
        """Load new weights between two decode steps; tokens sampled afterwards carry
        ``version``. Sequences still in flight continue with the new weights. An engine
        that cannot take adapters raises ``TypeError`` on an :class:`AdapterUpdate`."""
        ...

    async def shutdown(self) -> None: ...


class StreamingEngine(RolloutEngine, Protocol):
    """An engine that hands out a request's tokens as it samples them (both built-in ones).
    What a caller needs from it is only a stream of what ``generate`` returns anyway: the
    completion, and so every recorded trajectory, is the same with or without a sink."""

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       on_tokens: TokenSink | None = None) -> Completion:
        """As ``RolloutEngine.generate``; ``on_tokens`` gets each step's new token ids on the
        caller's event loop, in order, all of them before the completion is returned (an
        aborted request's too: they are its partial tokens)."""
        ...
