"""A multi-turn `verifiers` taskset in the package's own format (verifiers>=0.4): the
addition tasks of addition_taskset.py, with a toolset the model may call (`calc_add`)
before it answers. asyncrl answers the tool calls in-process (asyncrl/rollout/workflows/verifiers_agent.py)
and scores the final reply with the task's `@vf.reward`.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @classmethod
    def toolsets(cls, config):
        return [CalcToolset(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        """1 when the final reply's first integer is the sum."""
        found = re.search(r"-?\d+", trace.last_reply)
        return float(found is not None and int(found.group()) == task.answer)


class CalculatorTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        rng = random.Random(1)
        for _ in range(40):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=a + b))


__all__ = ["CalculatorTaskset"]
