"""The three schedules as definitions: η per mode, a trajectory's staleness, and what a
weight sync does to generation under way.

They live on the ground floor, apart from the gate that enforces them
(``orchestrator/staleness.py``), because the config validates against them, the runtime's
handles are typed by them, and the report and benchmarks compute with them: none of
those should have to import the orchestrator to know what a mode means. Defined once
here; everything else imports them.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["Mode", "PartialRollout", "effective_max_staleness", "effective_partial_rollout", "trajectory_staleness"]

Mode = Literal["sync", "one_step_off", "async"]
PartialRollout = Literal["abort", "continue", "off"]


def effective_max_staleness(mode: str, max_staleness: int) -> int:
    """η that ``mode`` enforces: ``sync`` is 0 (on-policy), ``one_step_off`` is 1, and
    ``async`` takes the configured ``max_staleness``."""
    return {"sync": 0, "one_step_off": 1}.get(mode, max_staleness)


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
