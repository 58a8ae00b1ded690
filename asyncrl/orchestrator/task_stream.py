"""The order in which train tasks are handed out, and what a resume needs of it."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from asyncrl.orchestrator.task_sampler import TaskSampler
from asyncrl.seeding import derive_seed
from asyncrl.tasks.base import Task


class Draw(NamedTuple):
    """One hand-out of a task."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index, on purpose: Draw.index is public
    """The task's index in the train split."""
    epoch: int
    """The epoch it was drawn in: part of its episodes' seeds (``asyncrl/seeding.py``)."""
    order: int | None = None
    """Its start order, once it has one: a task re-issued after a resume keeps its place,
    so batches are assembled as they would have been without the interruption."""


class TaskStream:
    """Train tasks in a fresh seeded order each epoch. The cursor (epoch, index) and the
    tasks to re-issue (handed out before a resume, never finished, each with its epoch and
    start order) are what a resume needs. With a ``sampler`` (``task.sampler: adaptive``)
    the cursor passes over some tasks (``asyncrl/orchestrator/task_sampler.py``)."""

    def __init__(self, tasks: list[Task], seed: int, epoch: int = 0, index: int = 0,
                 reissue: Iterable[Draw] = (), sampler: TaskSampler | None = None) -> None:
        """``reissue``: the draws to hand out again before the cursor's next task, in order."""
        self.tasks, self.seed = tasks, seed
        self.epoch, self.index = epoch, index
        self.reissue: deque[Draw] = deque(reissue)
        self.sampler = sampler
        self._order = self._shuffled()

    def _shuffled(self) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(derive_seed(self.seed, "task_order", self.epoch)).shuffle(order)
        return order

    @property
    def epochs_handed_out(self) -> int:
        """Epochs whose every task has been handed out (some may still be in flight)."""
        return self.epoch + (self.index == len(self._order))

    def next_draw(self) -> Draw:
        """Re-issued tasks first, with their own epoch and start order; then the epoch's
        next task the sampler, if any, does not pass over (no start order yet)."""
        if self.reissue:
            return self.reissue.popleft()
        while True:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled()
            self.index += 1
            index = self._order[self.index - 1]
            if self.sampler is None or self.sampler.visit(index, self.epoch, self.index - 1):
                return Draw(index, self.epoch)

    def next_index(self) -> int:
        return self.next_draw().index

    def next(self) -> Task:
        return self.tasks[self.next_index()]
