"""Which train tasks the task stream hands out: every one once an epoch (``task.sampler:
uniform``, the default), or fewer of those that teach nothing at present (``adaptive``).

A group whose samples all score the same has zero advantage and is filtered: its
generation teaches nothing (most of the Countdown example's groups: docs/results.md). Online
difficulty filtering — DAPO's dynamic sampling, the per-problem pass rates Kimi k1.5 and
Polaris sample by — spends less generation on such tasks. ``adaptive`` keeps, per task,
the outcomes of its last ``window`` groups: ``saturated`` (every sample solved: reward ≥
``eval.success_threshold``), ``hopeless`` (every sample scored the same, below it) or
``mixed``, and hands the task out, when the stream reaches it, with probability

    p = max(min_probability, (mixed + 1) / (n + 1))         n = outcomes kept

A task never seen, or mixed every time, is always handed out; each uninformative group
in its record lowers its chance (1/2, 1/3, …), never below ``min_probability``, so a
task the policy has outgrown or not yet grown into is looked at again now and then, and
its record follows the policy as it changes. Passed over, a task waits for the stream's
next epoch. Nothing is known of a task before its first group, so the sampler acts from
a task's second visit: a run that sees each task at most once (fewer groups than train
tasks) samples exactly as ``uniform`` does.

Deterministic given the seed: whether the stream's position ``(epoch, i)`` is handed out
is ``u < p`` with ``u`` a hash of the run's seed and that position, so the same outcomes
observed in the same order give the same draws, whatever was passed over before. (Which
outcomes are known at a draw is timing at η > 0, as a batch is.) The records are not
kept in a checkpoint: a resumed run learns them again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import MutableMapping, Sequence
from typing import Literal

from asyncrl.seeding import derive_seed

Outcome = Literal["saturated", "hopeless", "mixed"]

SAMPLER_COUNTS = ("sampler_skipped", "groups_saturated", "groups_hopeless")
"""``rollout/<name>_total``: positions of the stream the sampler passed over, and the groups
whose samples all scored the same, solved or not (filtered or not)."""


def group_outcome(rewards: Sequence[float], success_threshold: float) -> Outcome:
    """What a group's rewards say of its task now."""
    if min(rewards) != max(rewards):
        return "mixed"
    return "saturated" if rewards[0] >= success_threshold else "hopeless"


class TaskSampler:
    """Per-task records of recent outcomes and the visit probability they give."""

    def __init__(self, seed: int, window: int, min_probability: float,
                 counts: MutableMapping[str, int] | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 0 < min_probability <= 1:
            raise ValueError(f"min_probability must be in (0, 1], got {min_probability}")
        self.seed, self.window, self.min_probability = seed, window, min_probability
        self.counts = counts if counts is not None else {}
        self.counts.setdefault("sampler_skipped", 0)
        self.recent: dict[int, deque[bool]] = {}  # task index -> was each of its last groups mixed

    def observe(self, index: int, outcome: Outcome) -> None:
        """The outcome of a group of the task at ``index`` (of the train split)."""
        self.recent.setdefault(index, deque(maxlen=self.window)).append(outcome == "mixed")

    def probability(self, index: int) -> float:
        recent = self.recent.get(index)
        if not recent:
            return 1.0
        return max(self.min_probability, (sum(recent) + 1) / (len(recent) + 1))

    def visit(self, index: int, epoch: int, position: int) -> bool:
        """Whether the stream hands out the task at ``index``, reached at ``position`` of
        ``epoch``'s order; a pass is counted (``sampler_skipped``)."""
        p = self.probability(index)
        if p >= 1.0 or derive_seed(self.seed, "task_sampler", epoch, position) / 2**63 < p:
            return True
        self.counts["sampler_skipped"] += 1
        return False
