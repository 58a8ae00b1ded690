"""The schedule (mode, η, partial rollouts), written at the top level of a config."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from asyncrl.config.base import Section
from asyncrl.modes import effective_max_staleness, effective_partial_rollout


class ScheduleConfig(Section):
    """How generation and training overlap: the mode, η, what a weight sync does to
    generation under way, and how often weights sync (``asyncrl/modes.py`` turns them into
    the gate's η; ``asyncrl/orchestrator/staleness.py`` enforces it). Its keys are written at
    the top level, the names scripts use (``mode=async max_staleness=4``); a ``schedule:``
    block in a YAML file is read the same. The code reads them together, as ``cfg.schedule``."""

    flat: ClassVar[bool] = True  # keys named without the section's prefix (``all_keys``)

    mode: Literal["sync", "one_step_off", "async"] = "async"
    """``sync``: on-policy (η = 0); ``one_step_off``: η = 1, no partial rollout; ``async``: η = max_staleness."""
    max_staleness: int | float = Field(2, ge=0, allow_inf_nan=False)
    """η for ``async``, a non-negative real: at most ``floor(η · B)`` of a step's B groups
    started before the version it trains, and no trained token is older than ``ceil(η)``
    versions. ``0.5``: at most half of each batch comes from the previous version (verl's
    ``staleness_threshold``); an integer η bounds only the age."""
    partial_rollout: Literal["abort", "continue", "off"] = "abort"
    """At a weight sync, in-flight generation is aborted and resumed with the new weights
    (``abort``), continues with them (``continue``), or finishes on the old ones first (``off``)."""
    stale_groups: Literal["wait", "drop"] = "wait"
    """A group still generating (long responses) while younger ones are ready: the learner
    waits for it at the last step it is fresh for, so no group is dropped as older than η
    (``wait``), or trains the younger ones and drops it once it is older than η (``drop``:
    throws generation away, the longest responses first). See ``asyncrl/orchestrator/buffer.py``."""
    sync_every: int = Field(1, ge=1)
    """Optimizer steps between weight syncs to the engines; the last step syncs too, and so
    does a step whose evaluation runs on the engines (not beside training). The engines
    serve a version for this many steps, so samples are up to ``sync_every`` - 1 versions
    older when trained: at most η + 1, and η still bounds every trained token."""

    @field_validator("partial_rollout", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false

    @model_validator(mode="after")
    def _consistent(self) -> ScheduleConfig:
        if self.mode == "sync" and self.partial_rollout != "off" and "partial_rollout" in self.model_fields_set:
            raise ValueError("mode 'sync' has nothing in flight at a weight sync; set partial_rollout=off")
        if self.sync_every - 1 > self.effective_max_staleness:
            raise ValueError(f"sync_every={self.sync_every} trains on samples {self.sync_every - 1} versions old, "
                             f"beyond the staleness bound {self.effective_max_staleness} of mode {self.mode!r}; "
                             f"use sync_every <= {math.floor(self.effective_max_staleness) + 1}")
        return self

    @property
    def effective_max_staleness(self) -> float:
        """η the gate enforces in this mode (an int unless configured fractional)."""
        return effective_max_staleness(self.mode, self.max_staleness)

    @property
    def effective_partial_rollout(self) -> str:
        """What a weight sync does to generation under way in this mode."""
        return effective_partial_rollout(self.mode, self.partial_rollout)


SCHEDULE_KEYS = tuple(ScheduleConfig.model_fields)


def hoist_schedule_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a config as nested dicts) with its top-level schedule keys moved into
    ``schedule``, where :class:`Config` holds them. Pure."""
    top = {key: data[key] for key in SCHEDULE_KEYS if key in data}
    nested = data.get("schedule", {})
    if not top or not isinstance(nested, dict):
        return data  # a `schedule` that is not a mapping: validation says so
    return {**{k: v for k, v in data.items() if k not in top}, "schedule": {**nested, **top}}


def flatten_schedule_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with a ``schedule:`` block's keys at the top level, as they are named; a key
    given both ways raises ``ValueError`` naming both spellings. Pure."""
    nested = data.get("schedule")
    if not isinstance(nested, dict):
        return data
    both = sorted(set(nested) & set(data))
    if both:
        raise ValueError(f"{both[0]!r} is given twice, as {both[0]} and as schedule.{both[0]}; keep one")
    return {**{k: v for k, v in data.items() if k != "schedule"}, **nested}
