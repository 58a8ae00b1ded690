"""The order in which train tasks are handed out, and what a resume needs of it."""

from __future__ import annotations

import random
from collections import deque

from asyncrl.tasks.base import Task


class TaskStream:
    """Train tasks in a fresh seeded order each epoch. The cursor (epoch, index) and the
    tasks to re-issue (handed out before a resume, never finished, with the epoch each was
    drawn in) are what a resume needs."""

    def __init__(self, tasks: list[Task], seed: int, epoch: int = 0, index: int = 0,
                 reissue: list[int] | None = None, reissue_epochs: list[int] | None = None) -> None:
        """``reissue_epochs``: the draw (epoch) of each ``reissue`` entry; a checkpoint from
        before they were saved has none, and its entries count as drawn in ``epoch``."""
        self.tasks, self.seed = tasks, seed
        self.epoch, self.index = epoch, index
        reissue = list(reissue or [])
        draws = list(reissue_epochs or [])[:len(reissue)]
        self.reissue: deque[tuple[int, int]] = deque(zip(reissue, draws + [epoch] * (len(reissue) - len(draws))))
        self._order = self._shuffled()

    def _shuffled(self) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    @property
    def epochs_handed_out(self) -> int:
        """Epochs whose every task has been handed out (some may still be in flight)."""
        return self.epoch + (self.index == len(self._order))

    def next_draw(self) -> tuple[int, int]:
        """(task index, the epoch it is drawn in): re-issued tasks first, with their own epoch."""
        if self.reissue:
            return self.reissue.popleft()
        if self.index == len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._shuffled()
        self.index += 1
        return self._order[self.index - 1], self.epoch

    def next_index(self) -> int:
        return self.next_draw()[0]

    def next(self) -> Task:
        return self.tasks[self.next_index()]
