"""The group buffer between rollouts and the learner.

Hands the learner the oldest-started ready groups first, and never a trajectory older
than η: a group that aged past the bound while it waited (out-of-order completion) is
dropped here and its quota released to the gate (see ``staleness.py`` for why the gate
alone cannot promise the age).

A batch is its groups in start order, and start order is the task stream's order (a
re-issued task after a resume aside). At η = 0 that makes a batch independent of the
order groups finish in: the gate lets at most B groups hold quota beyond those trained,
so when B are ready none is running, and each rejected group was replaced by the next
task of the stream; the batch is the shortest stretch of the stream holding B accepted
groups, in stream order — exactly ``mode=sync``'s. With per-episode seeds
(``asyncrl/seeding.py``) that makes ``mode=async`` with ``max_staleness=0`` train on
``mode=sync``'s samples (``tests/test_reproducible.py``). At η > 0 which groups are
ready when the learner asks is timing, and so is a batch.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from asyncrl.orchestrator.staleness import AsyncStalenessGate, check_staleness
from asyncrl.types import Group, Trajectory


@dataclass
class ReadyGroup:
    group: Group
    start_order: int  # the gate admitted groups in this order

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for e in self.group.episodes for t in e.trajectories]

    @property
    def oldest_version(self) -> int:
        """The oldest policy version any of its model tokens came from."""
        return min(t.behavior_version_min for t in self.trajectories)


class GroupBuffer:
    def __init__(self, gate: AsyncStalenessGate, max_staleness: int) -> None:
        self.gate = gate
        self.max_staleness = max_staleness
        self.stale_dropped = 0
        self._ready: list[ReadyGroup] = []
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._ready)

    async def put(self, ready: ReadyGroup) -> None:
        await self.gate.accept()
        async with self._changed:
            self._ready.append(ready)
            self._changed.notify_all()

    def snapshot(self) -> list[ReadyGroup]:
        """The groups waiting now (for a checkpoint)."""
        return list(self._ready)

    def restore(self, groups: list[ReadyGroup]) -> None:
        """Groups saved with a checkpoint; the restored gate already counts them as accepted."""
        self._ready.extend(groups)

    async def take(self, n: int, trained_version: int) -> list[ReadyGroup]:
        """Wait for ``n`` groups fresh enough to train version ``trained_version`` on."""
        async with self._changed:
            while True:
                stale = [g for g in self._ready if trained_version - g.oldest_version > self.max_staleness]
                for group in stale:
                    self._ready.remove(group)
                    self.stale_dropped += 1
                    await self.gate.release_rejected(was_accepted=True)
                if len(self._ready) >= n:
                    self._ready.sort(key=lambda g: g.start_order)
                    taken, self._ready = self._ready[:n], self._ready[n:]
                    return taken
                await self._changed.wait()


def trainable(groups: list[ReadyGroup], trained_version: int, max_staleness: int) -> tuple[list[Trajectory], list[float]]:
    """The trajectories of ``groups`` with their episodes' advantages, each checked to be
    at most ``max_staleness`` versions old at ``trained_version`` (the learner's side of
    the bound: anything older is a bug upstream, and stops the run)."""
    trajectories, advantages = [], []
    for g in groups:
        for episode, advantage in zip(g.group.episodes, g.group.advantages or []):
            for t in episode.trajectories:
                check_staleness(trained_version, t.behavior_version_min, max_staleness,
                                f"a trajectory of task {g.group.task_id}")
                trajectories.append(t)
                advantages.append(advantage)
    return trajectories, advantages
