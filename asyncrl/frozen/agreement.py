"""How far a judge can be trusted where a checker exists: its pass/fail verdicts on the same
responses set against the task's own checker, as a confusion table, the share of agreement
and Cohen's kappa (agreement beyond what two raters with these pass rates would reach by
chance). ``examples/judge/agreement.py`` runs a policy's responses through both.

Pure counting: :class:`Agreement` from ``(judge passes, checker passes)`` pairs, and
:func:`grade_all`, the judge's grades of many responses with each failure kept (a judge that
does not answer is counted, never scored 0).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from asyncrl.frozen.client import FrozenModelError
from asyncrl.frozen.judge import GradedTask, JudgeReward


@dataclass(frozen=True)
class Agreement:
    """The 2×2 table of a judge's verdicts against a checker's on the same responses."""

    both_pass: int
    judge_only: int  # the judge passes what the checker fails (a false pass)
    checker_only: int  # the judge fails what the checker passes (a false fail)
    both_fail: int

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[bool, bool]]) -> Agreement:
        """``pairs``: ``(the judge passes, the checker passes)`` per response."""
        counts = [0, 0, 0, 0]
        for judge, checker in pairs:
            counts[(0 if checker else 1) if judge else (2 if checker else 3)] += 1
        return cls(*counts)

    @property
    def n(self) -> int:
        return self.both_pass + self.judge_only + self.checker_only + self.both_fail

    @property
    def accuracy(self) -> float:
        """The share of responses on which the two agree (NaN with none)."""
        return (self.both_pass + self.both_fail) / self.n if self.n else math.nan

    @property
    def chance(self) -> float:
        """The agreement two independent raters with these pass rates would reach:
        p_judge · p_checker + (1 − p_judge)(1 − p_checker)."""
        if not self.n:
            return math.nan
        judge = (self.both_pass + self.judge_only) / self.n
        checker = (self.both_pass + self.checker_only) / self.n
        return judge * checker + (1 - judge) * (1 - checker)

    @property
    def kappa(self) -> float:
        """Cohen's kappa, (p_o − p_e) / (1 − p_e): 1 perfect agreement, 0 chance's, below 0
        worse. NaN where p_e = 1 (both raters gave every response one and the same verdict:
        there is no agreement beyond chance to measure)."""
        observed, chance = self.accuracy, self.chance
        return (observed - chance) / (1 - chance) if self.n and chance < 1 else math.nan

    def lines(self) -> list[str]:
        """The table and the figures, for a terminal."""
        return [f"responses judged and checked: {self.n}",
                f"  judge pass & checker pass: {self.both_pass}    judge pass & checker fail: {self.judge_only}",
                f"  judge fail & checker pass: {self.checker_only}    judge fail & checker fail: {self.both_fail}",
                f"agreement (accuracy): {self.accuracy:.3f}; by chance: {self.chance:.3f}; "
                f"Cohen's kappa: {self.kappa:.3f}"]


@dataclass(frozen=True)
class Graded:
    """The judge's reward for one response, or why there is none."""

    reward: float | None
    error: str | None = None


async def grade_all(judge: JudgeReward, items: Sequence[tuple[GradedTask, str]]) -> list[Graded]:
    """The judge's reward for each ``(task, response)``, all asked at once (the judge's client
    bounds how many are in flight); a call that fails is kept as its error."""
    async def one(task: GradedTask, response: str) -> Graded:
        try:
            return Graded(await judge(task, response))
        except FrozenModelError as exc:
            return Graded(None, str(exc))

    return list(await asyncio.gather(*(one(task, response) for task, response in items)))
