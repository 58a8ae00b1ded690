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

from collections.abc import Callable
from typing import ClassVar, Protocol


from asyncrl.config.engine_kinds import EngineKind, PauseMode
from asyncrl.types import Completion, SamplingParams
from asyncrl.weight_updates import (  # noqa: F401 (the update types, importable from the engine's contract too)
    AdapterUpdate,
    FullWeights,
    LayerAdapter,
    WeightUpdate,
    as_update,
    flatten_update,
    unflatten_update,
)

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
