"""What an invariant's verdict is made of: the statuses, a run's own limits (from its
``config.yaml``) and :class:`Finding`, shared by the step checks, the run checks
(``invariants.py``), the frozen models' (``frozen_invariants.py``) and ``asyncrl doctor``.
Pure: rows in, findings out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.weight_sync.delivery import check_tolerance

Row = dict[str, Any]
OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"
SEVERITY = {SKIP: 0, OK: 0, WARN: 1, FAIL: 2}
"""A finding's weight in ``asyncrl doctor``'s exit status: the worst one's."""


def num(row: Row | None, key: str) -> float | None:
    """``row[key]`` as a float; None where it is missing, not a number, or not finite."""
    value = None if row is None else row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def step_of(row: Row) -> int:
    """The optimizer step a row is of."""
    return int(row["step"])


@dataclass(frozen=True)
class Limits:
    """The bounds a run set itself, from its ``config.yaml``."""

    check_tolerance: float = 1e-4  # weight_sync.check_tolerance
    max_staleness: float | None = None  # η enforced (None: unknown)
    starvation_warn_fraction: float = 0.9  # watchdog.starvation_warn_fraction
    total_steps: int | None = None
    batch_size: int | None = None  # B, groups a step trains: the off-policy share of a fractional η
    critic: bool = False  # a critic's per-token advantages (gae): a group whose samples all scored the same trains

    @classmethod
    def from_config(cls, config: Row, max_staleness: float | None) -> Limits:
        def get(section: str, key: str, default: Any) -> Any:
            part = config.get(section)
            value = part.get(key) if isinstance(part, dict) else None
            return default if value is None else value

        total, batch = config.get("total_steps"), config.get("batch_size")
        weights = str(get("model", "dtype", "float32"))  # the tolerance the run resolved (delivery.py)
        tolerance = check_tolerance(get("weight_sync", "check_tolerance", None), weights,
                                    str(get("rollout", "dtype", weights)))
        return cls(float(tolerance), max_staleness,
                   float(get("watchdog", "starvation_warn_fraction", 0.9)),
                   total if isinstance(total, int) and not isinstance(total, bool) else None,
                   batch if isinstance(batch, int) and not isinstance(batch, bool) and batch > 0 else None,
                   bool(config.get("critic")))


@dataclass(frozen=True)
class Finding:
    """One invariant's verdict on a run: ``step`` is the first step it broke (None if none)."""

    name: str
    status: str
    step: int | None
    evidence: str
    fix: str = ""

    def line(self) -> str:
        """``STATUS  name: evidence [first at step N] → fix`` (the fix only when broken)."""
        at = f" (first at step {self.step})" if self.step is not None and self.status in (WARN, FAIL) else ""
        fix = f"; fix: {self.fix}" if self.status in (WARN, FAIL) and self.fix else ""
        return f"{self.status:<4}  {self.name}: {self.evidence}{at}{fix}"


def worst(findings: Sequence[Finding]) -> int:
    """The exit status the findings make: 0 all OK (or skipped), 1 a WARN, 2 a FAIL."""
    return max((SEVERITY[f.status] for f in findings), default=0)
