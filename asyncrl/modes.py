"""The three schedules as definitions: η per mode, a trajectory's staleness, and what a
weight sync does to generation under way.

They live on the ground floor, apart from the gate that enforces them
(``orchestrator/staleness.py``), because the config validates against them, the runtime's
handles are typed by them, and the report and benchmarks compute with them: none of
those should have to import the orchestrator to know what a mode means. Defined once
here; everything else imports them.
"""

from __future__ import annotations

from fractions import Fraction
from math import ceil, floor
from typing import Literal

__all__ = ["Mode", "PartialRollout", "effective_max_staleness", "effective_partial_rollout", "off_policy_groups",
           "staleness_fraction", "staleness_lag", "trajectory_staleness"]

Mode = Literal["sync", "one_step_off", "async"]
PartialRollout = Literal["abort", "continue", "off"]


def effective_max_staleness(mode: str, max_staleness: float) -> float:
    """η that ``mode`` enforces: ``sync`` is 0 (on-policy), ``one_step_off`` is 1, and
    ``async`` takes the configured ``max_staleness`` (a non-negative real)."""
    return {"sync": 0, "one_step_off": 1}.get(mode, max_staleness)


def staleness_fraction(max_staleness: float) -> Fraction:
    """η as an exact fraction: a float is read as the decimal it prints as, so ``0.3`` is
    3/10 and not the binary float just below it (whose ``floor(η · 10)`` would be 2)."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, (int, float, Fraction)):
        raise ValueError(f"max_staleness must be a number, got {max_staleness!r}")
    eta = Fraction(repr(max_staleness)) if isinstance(max_staleness, float) else Fraction(max_staleness)
    if eta < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return eta


def staleness_lag(max_staleness: float) -> int:
    """The age bound η implies: a trained token is at most ``ceil(η)`` versions old
    (``orchestrator/staleness.py`` proves it). Every check of a sample's age uses this."""
    return ceil(staleness_fraction(max_staleness))


def off_policy_groups(max_staleness: float, groups_per_step: int) -> int:
    """``floor(η · B)``: the most of a step's ``B`` groups started before the version that
    step trains (``orchestrator/staleness.py`` proves it); η < 1 makes it a share of a batch."""
    return floor(staleness_fraction(max_staleness) * groups_per_step)


def effective_partial_rollout(mode: str, partial_rollout: str) -> PartialRollout:
    """What happens to in-flight generation at a weight sync. Only ``async`` continues or
    aborts it; ``sync`` has nothing in flight and ``one_step_off`` finishes it on the old
    weights (``off``), whatever ``partial_rollout`` says."""
    return partial_rollout if mode == "async" else "off"  # type: ignore[return-value]


def trajectory_staleness(trained_version: int, behavior_version_min: int) -> int:
    """Versions between the oldest weights that produced a trajectory's model tokens and
    the learner version that trains on it (``samples.jsonl``: ``trained_version −
    behavior_version_min``)."""
    return trained_version - behavior_version_min
