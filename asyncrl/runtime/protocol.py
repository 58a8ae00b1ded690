"""The two handles the orchestrator holds: one learner, one rollout side.

Both runtimes (``local``: this process; ``ray``: actors) implement them with the same
explicit methods, so the trainer reads the same whichever runs underneath. Published
weights are opaque to the orchestrator: a dict of tensors in-process, an object-store
reference on Ray; it only carries them from ``publish`` to ``sync_weights``/``evaluate``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from asyncrl.evaluation import EvalResult
from asyncrl.learner import TrainBatch
from asyncrl.orchestrator.staleness import PartialRollout
from asyncrl.tasks.base import Task
from asyncrl.types import Episode

Weights = Any
"""What ``LearnerHandle.publish`` returns: a snapshot of the weights at one version."""


class LearnerHandle(Protocol):
    async def train_step(self, batch: TrainBatch, on_policy: bool) -> dict[str, float]:
        """One optimizer step (one new version); returns the step's ``actor/*`` metrics."""
        ...

    async def publish(self) -> Weights:
        """A snapshot of the current weights; the learner may train on while engines load it."""
        ...

    async def save_checkpoint(self, path: Path, extra: dict[str, Any], files: dict[str, str]) -> Path: ...

    async def load_checkpoint(self, path: Path) -> int:
        """Weights, optimizer, schedule and RNG of ``path``; returns its version."""
        ...

    async def shutdown(self) -> None: ...


class RolloutHandle(Protocol):
    @property
    def restarts(self) -> int:
        """Rollout workers replaced after dying, in this process's lifetime."""
        ...

    async def run_group(self, task: Task, n: int) -> list[Episode]:
        """``n`` episodes of ``task``; a failing episode comes back with status ``error``."""
        ...

    async def evaluate(self, tasks: list[Task], *, version: int, weights: Weights | None = None,
                       on_episode: Callable[[Episode], None] | None = None) -> EvalResult:
        """Score ``tasks`` on ``version``: with ``weights``, on an evaluation replica that
        loads them (training goes on meanwhile); without, on the rollout engines, which
        must serve ``version`` and receive no sync until this returns."""
        ...

    async def sync_weights(self, weights: Weights, version: int, mode: PartialRollout) -> None:
        """Every engine serves ``version`` when this returns; ``mode`` says what happens to
        generation under way (see ``RolloutWorker.sync_weights``)."""
        ...

    async def busy_s(self) -> float:
        """Seconds the engines spent generating (mean per worker), for the idle ratios."""
        ...

    async def gateway_counts(self) -> dict[str, int]:
        """What the workers' gateways counted (``tool_parse_errors``, ``sampling_overrides``),
        summed; zeros where no gateway runs."""
        ...

    async def shutdown(self) -> None: ...
