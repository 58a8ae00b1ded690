"""A tiny `verifiers` taskset in the package's own format (verifiers>=0.4, `verifiers.v1`):
a `Taskset` whose `load()` yields typed tasks, each task's `@vf.reward` methods its rubric.

Single-digit addition, the shipped models/addition-tiny's task. asyncrl trains on it with
examples/verifiers_env/train.yaml; the same file is a taskset any verifiers tool could load.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf


class AdditionData(vf.TaskData):
    answer: int
    """The sum, the reference the rubric checks against."""


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward(weight=1.0)
    async def correct(self, task: AdditionData, trace: vf.Trace) -> float:
        """1 when the reply's first integer is the sum."""
        found = re.search(r"-?\d+", trace.last_reply)
        return float(found is not None and int(found.group()) == task.answer)


class AdditionTaskset(vf.Taskset[AdditionTask, vf.TasksetConfig]):
    def load(self):
        rng = random.Random(0)
        for _ in range(200):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            yield AdditionTask(AdditionData(prompt=f"{a}+{b}=", answer=a + b))


__all__ = ["AdditionTaskset"]
