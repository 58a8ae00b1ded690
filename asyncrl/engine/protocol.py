"""The rollout engine contract every implementation (built-in torch, vLLM) keeps.

Verbs follow vLLM's RL hooks: ``pause(mode)``, ``update_weights(weights, version)``,
``resume()``. All are async: the orchestrator and many workflow tasks call them from one
event loop while the engine generates elsewhere (a thread, a process, another node).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, Protocol

import torch

from asyncrl.types import Completion, SamplingParams

PauseMode = Literal["keep", "abort", "wait"]
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


class RolloutEngine(Protocol):
    @property
    def version(self) -> int: ...

    @property
    def stats(self) -> RolloutEngineStats: ...

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        """Sample one completion. Cancelling the awaiting task aborts the request."""
        ...

    async def pause(self, mode: PauseMode = "keep") -> int | None:
        """Stop between two decode steps. ``keep``: in-flight sequences wait with their KV
        cache; ``abort``: they return now with finish reason ``abort`` and their partial
        tokens (the client resumes them); ``wait``: admit nothing new and return once the
        in-flight sequences have finished on the current weights. Returns how many running
        sequences ``abort`` ended, where the engine knows (None where it does not)."""
        ...

    async def resume(self) -> None: ...

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights between two decode steps; tokens sampled afterwards carry
        ``version``. Sequences still in flight continue with the new weights."""
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
