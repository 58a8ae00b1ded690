"""What one optimizer step measured, and the metrics row it becomes: the train loop's
bookkeeping in one place beside the loop, so the loop reads as the story it tells.

A step's times are on the event loop's clock (a simulated one under ``asyncrl plan``);
the engines' work comes from ``RolloutHandle.engine_work``, read when the step starts,
around each learner call (the engines' busy seconds meanwhile are the learner's
*overlap*: on shared cores the two slow each other, and ``asyncrl plan --from`` fits by
how much) and when the step ends. A step's figures are differences of two readings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from asyncrl.orchestrator.buffer import ReadyGroup
from asyncrl.orchestrator.metrics import StepTimes, step_row
from asyncrl.runtime import RolloutHandle
from asyncrl.core_budget import SIDES
from asyncrl.types import Trajectory

T = TypeVar("T")


@dataclass(frozen=True)
class EngineWork:
    """One reading of what the engines did so far: ``busy_s`` (mean per engine) and every
    count the rollout side keeps (``RolloutHandle.engine_work`` names them)."""

    busy_s: float
    counts: Mapping[str, float]

    @classmethod
    async def read(cls, rollout: RolloutHandle) -> EngineWork:
        work = await rollout.engine_work()
        return cls(work["busy_s"], work)

    def since(self, before: EngineWork) -> dict[str, float]:
        """What the engines did between ``before`` and this reading, every key (a key this
        reading has and ``before`` lacks counts from 0: an engine still starting then)."""
        return {key: value - before.counts.get(key, 0) for key, value in self.counts.items()}


@dataclass
class Trained:
    """One step's training: its groups and trajectories, the learner's ``actor/*`` metrics,
    the seconds it waited for groups with nothing to compute and the seconds it computed."""

    groups: list[ReadyGroup] = field(default_factory=list)
    trajectories: list[Trajectory] = field(default_factory=list)
    actor: dict[str, float] = field(default_factory=dict)
    waited_s: float = 0.0
    learner_s: float = 0.0
    overlap_s: float = 0.0  # the engines' busy seconds (mean per engine) during the learner's calls


@dataclass(frozen=True)
class RolloutSide:
    """The rollout side's part of a step's row, read at the step's end *before* the weight
    sync opens the gate to the next version (after it, what has finished is timing):
    the starvation window's filtered fraction, the group and gateway counters, every
    episode's reward finished since the last step (filtered groups included), the buffer."""

    filtered_window: float | None
    counters: dict[str, int]
    finished_rewards: list[float]
    buffer: dict[str, int]


async def learner_call(rollout: RolloutHandle, trained: Trained, call: Awaitable[T]) -> T:
    """``call``'s value, its seconds counted into ``trained.learner_s`` and the engines'
    busy seconds meanwhile into ``trained.overlap_s``."""
    start = _clock()
    before, out = await asyncio.gather(EngineWork.read(rollout), call)
    trained.learner_s += _clock() - start
    trained.overlap_s += (await EngineWork.read(rollout)).busy_s - before.busy_s
    return out


class StepMeter:
    """One step's clock and the engines' work around it; :meth:`row` builds its metrics."""

    def __init__(self, rollout: RolloutHandle, started: float, work: EngineWork) -> None:
        # start_s, not started: that name is the classmethod below, which an attribute would hide
        self.rollout, self.start_s, self.start_work = rollout, started, work
        self.sync_s = 0.0  # the weight sync took

    @classmethod
    async def started(cls, rollout: RolloutHandle) -> StepMeter:
        return cls(rollout, _clock(), await EngineWork.read(rollout))

    async def timed_sync(self, sync: Awaitable[T]) -> T:
        start = _clock()
        try:
            return await sync
        finally:
            self.sync_s += _clock() - start

    async def row(self, step: int, version: int, trained_version: int, trained: Trained, elapsed_s: float,
                  finished_rewards: list[float], counters: Mapping[str, int], buffer: Mapping[str, int],
                  filtered_fraction_window: float | None, errors_unlogged: int) -> dict[str, Any]:
        """The step's ``metrics.jsonl`` row; the engines' work read now, at the step's end."""
        work = (await EngineWork.read(self.rollout)).since(self.start_work)
        times = StepTimes(_clock() - self.start_s, trained.waited_s, work["busy_s"], elapsed_s)
        row = step_row(step, version, trained_version, trained.groups, trained.trajectories, trained.actor, times,
                       finished_rewards, counters, buffer, filtered_fraction_window=filtered_fraction_window)
        row["rollout/errors_unlogged_total"] = errors_unlogged  # failed attempts past errors.jsonl's cap
        # the learner computing against the whole step: waits for data, the weight sync and
        # the logging are its idle time
        row["time/learner"], row["time/weight_sync"] = trained.learner_s, self.sync_s
        row["time/learner_overlap"] = trained.overlap_s
        for side in SIDES:  # rollout.thread_sharing: colocated — each side's seconds at every core and waiting
            if f"{side}_all_cores_s" in work:  # for one, and its switches of count (ThreadBudget.counters)
                row[f"time/{side}_all_cores_s"] = work.pop(f"{side}_all_cores_s")
                row[f"time/{side}_core_wait_s"] = work.pop(f"{side}_waited_s")
                row[f"threads/{side}_switches"] = work.pop(f"{side}_switches")
        # what the engines did meanwhile, summed over them: what `asyncrl plan --from` fits their costs to
        row.update({f"rollout/{key}": value for key, value in work.items()})
        row.update({f"remote/{key}": value for key, value in (await self.rollout.engine_fleet()).items()})
        row["trainer/learner_idle_ratio"] = max(0.0, 1 - trained.learner_s / times.wall_s)
        return row


def _clock() -> float:
    """The event loop's clock: every time a run measures is on it, so on a simulated clock
    (``asyncrl plan``: ``asyncrl/plan/virtual_clock.py``) the metrics are in simulated seconds."""
    return asyncio.get_running_loop().time()
