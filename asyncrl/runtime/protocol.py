"""The two handles the orchestrator holds: one learner, one rollout side.

Both runtimes (``local``: this process; ``ray``: actors) implement them with the same
explicit methods, so the trainer reads the same whichever runs underneath. Published
weights are opaque to the orchestrator: a dict of tensors in-process, an object-store
reference on Ray; it only carries them from ``publish`` to ``sync_weights``/``evaluate``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from asyncrl.eval_scoring import EvalResult
from asyncrl.learner import TrainBatch
from asyncrl.modes import PartialRollout
from asyncrl.tasks.base import Task
from asyncrl.types import Episode

Weights = Any
"""What ``LearnerHandle.publish`` returns: a snapshot of the weights at one version."""


@dataclass(frozen=True)
class SyncAddress:
    """Where a rollout worker meets the learner for ``weight_sync.method: collective``:
    the learner's store and what the group is made of (``runtime/weight_sync.py``)."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float


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

    # weight_sync.method: collective (runtime/weight_sync.py) — the learner is rank 0
    async def open_weight_sync(self, receivers: int, bucket_mb: float, timeout_s: float,
                               backend: str) -> SyncAddress:
        """Host the group's store for ``receivers`` engines; returns where they meet it."""
        ...

    async def connect_weight_sync(self) -> None:
        """Wait for every receiver to join, then form the group; raises naming a missing one."""
        ...

    async def send_weights(self, version: int) -> None:
        """Broadcast the current weights as ``version``; returns once every receiver has them."""
        ...

    async def close_weight_sync(self) -> None: ...

    async def shutdown(self) -> None: ...


class RolloutHandle(Protocol):
    @property
    def restarts(self) -> int:
        """Rollout workers replaced after dying, in this process's lifetime."""
        ...

    async def run_group(self, task: Task, n: int, draw: int = 0) -> list[Episode]:
        """``n`` episodes of ``task``; a failing episode comes back with status ``error``.
        ``draw``: the train epoch the task was handed out in (part of the episodes' seeds,
        ``asyncrl/seeding.py``)."""
        ...

    async def evaluate(self, tasks: list[Task], *, version: int, weights: Weights | None = None,
                       on_episode: Callable[[Episode], None] | None = None) -> EvalResult:
        """Score ``tasks`` on ``version``: with ``weights``, on an evaluation replica that
        loads them (training goes on meanwhile); without, on the rollout engines, which
        must serve ``version`` and receive no sync until this returns."""
        ...

    async def sync_weights(self, weights: Weights, version: int, mode: PartialRollout) -> list[int]:
        """Every engine serves ``version`` when this returns; ``mode`` says what happens to
        generation under way (see ``RolloutWorker.sync_weights``). Returns the version each
        engine reports serving (a Ray worker replaced meanwhile starts from these weights)."""
        ...

    async def join_weight_sync(self, address: SyncAddress) -> None:
        """Every engine joins the learner's weight-sync group (rollout worker i as rank i+1)."""
        ...

    async def receive_weights(self, version: int, mode: PartialRollout) -> list[int]:
        """Every engine receives ``version`` from the learner's broadcast and loads it as
        ``sync_weights`` would; returns the version each one serves afterwards."""
        ...

    async def leave_weight_sync(self) -> None: ...

    async def fingerprints(self) -> list[tuple[int, str]]:
        """Per engine: the version it serves and a digest of its weights
        (``weight_sync.fingerprint``): a pass over every weight, for checks, not every step."""
        ...

    async def busy_s(self) -> float:
        """Seconds the engines spent generating (mean per worker), for the idle ratios."""
        ...

    async def gateway_counts(self) -> dict[str, int]:
        """What the workers' gateways counted (``tool_parse_errors``, ``sampling_overrides``)
        and ``user_threads_abandoned`` (blocking user calls given up on), summed over the
        workers; zeros where nothing was counted."""
        ...

    async def shutdown(self) -> None: ...
