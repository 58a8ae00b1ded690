"""A training run directory, parsed once and checked on the way in.

``config.yaml`` and ``metrics.jsonl`` are required. ``samples.jsonl`` and
``timeline.jsonl`` are missing only from a run killed early (a warning: their figures
will be empty). ``errors.jsonl`` exists only where an episode attempt failed, so its
absence is silent. A torn last line, what a killed writer leaves, is skipped with a
warning; any other broken line is a ``ValueError`` naming the file and line.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncrl.config import CONFIG_CHANGES_FILE
from asyncrl.jsonl import iter_jsonl
from asyncrl.modes import effective_max_staleness, staleness_lag

Row = dict[str, Any]
"""One line of a run's JSONL file."""


def finite(value: Any) -> float | None:
    """A finite number, or None (missing, NaN, bool, string): what a figure can plot."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def evaluated_step(row: Row) -> float | None:
    """The policy version an eval row scored. Evaluation concurrent with training lands
    in a later step's row and names its version in ``eval/version``; without that key
    the row's own step was evaluated (version ``v`` is the policy after ``v`` steps)."""
    version = finite(row.get("eval/version"))
    return version if version is not None else finite(row.get("step"))


@dataclass
class Run:
    """The parsed contents of one training run directory."""

    run_dir: Path
    config: dict[str, Any]
    """The settings the run trains with now: ``config.yaml`` with ``config_changes.jsonl``
    applied (``config_text`` is ``config.yaml`` as written)."""
    metrics: list[Row]
    samples: list[Row] = field(default_factory=list)
    timeline: list[Row] = field(default_factory=list)
    config_text: str = ""
    errors: list[Row] = field(default_factory=list)
    """Failed episode attempts (``errors.jsonl``), train and eval."""

    @property
    def mode(self) -> str:
        return str(self.config.get("mode", "unknown"))

    @property
    def max_staleness(self) -> float | None:
        """η the run enforced; None when the config does not say (no ``max_staleness``)."""
        configured = self.config.get("max_staleness")
        if isinstance(configured, bool) or not isinstance(configured, (int, float)) or not 0 <= configured < math.inf:
            return None
        return effective_max_staleness(self.mode, configured)

    @property
    def max_lag(self) -> int | None:
        """``ceil(η)``: the most versions old a trained sample may be; None when η is unknown."""
        return None if self.max_staleness is None else staleness_lag(self.max_staleness)

    @property
    def train_metrics(self) -> list[Row]:
        """Rows of optimizer steps (step ≥ 1); step 0 is the evaluation before training."""
        return [r for r in self.metrics if (finite(r.get("step")) or 0) >= 1]

    @property
    def eval_metrics(self) -> list[Row]:
        """Rows that carry an evaluation result."""
        return [r for r in self.metrics if finite(r.get("eval/reward_mean")) is not None]

    def intervals(self, kind: str) -> list[tuple[float, float]]:
        """``(start, end)`` seconds of every timeline event of ``kind`` (generate, train, sync, eval)."""
        return [(float(e["start"]), float(e["end"])) for e in self.timeline if e.get("kind") == kind]


def _read_rows(path: Path, required: tuple[str, ...]) -> list[Row]:
    """Rows of one of the run's JSONL logs; each must hold the ``required`` keys."""
    rows = []
    for line_no, row in iter_jsonl(path, torn_tail="drop"):
        missing = [k for k in required if k not in row]
        if missing:
            raise ValueError(f"{path}, line {line_no} lacks {', '.join(map(repr, missing))}")
        rows.append(row)
    return rows


def _read_config(path: Path) -> tuple[dict[str, Any], str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(config, dict):  # a bad file, not a bad argument: the CLI reports ValueError
        raise ValueError(f"{path} must hold a mapping of keys, got {type(config).__name__}")  # noqa: TRY004
    return config, text


def _current(config: dict[str, Any], changes: Path) -> dict[str, Any]:
    """``config.yaml`` (the settings the run started with) with each resume's changes from
    ``config_changes.jsonl`` applied in order (dotted keys): the settings it trains with
    now, e.g. a ``total_steps`` raised on resume."""
    if not changes.is_file():
        return config
    for line_no, row in iter_jsonl(changes):
        changed = row.get("changed") if isinstance(row, dict) else None
        if not isinstance(changed, dict):
            raise ValueError(f"{changes}, line {line_no} lacks a 'changed' mapping")  # noqa: TRY004
        for key, change in changed.items():
            *parents, last = str(key).split(".")
            node = config
            for part in parents:
                if not isinstance(node.get(part), dict):
                    node[part] = {}
                node = node[part]
            node[last] = change["new"] if isinstance(change, dict) and "new" in change else change
    return config


def load_run(run_dir: str | Path) -> Run:
    """Parse a run directory; FileNotFoundError / ValueError name the missing or bad file."""
    run_dir = Path(run_dir)
    hint = "is it an asyncrl train output directory?"
    if not run_dir.exists():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory: {hint}")
    for name in ("config.yaml", "metrics.jsonl"):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir} has no {name}: {hint}")
    config, config_text = _read_config(run_dir / "config.yaml")
    config = _current(config, run_dir / CONFIG_CHANGES_FILE)

    metrics_path = run_dir / "metrics.jsonl"
    metrics = _read_rows(metrics_path, required=("step",))
    if not metrics:
        raise ValueError(f"{metrics_path} has no rows: the run stopped before its first evaluation")
    if any(finite(r["step"]) is None for r in metrics):
        raise ValueError(f"{metrics_path} has a non-numeric 'step'")

    def optional(name: str, required: tuple[str, ...], warn: bool) -> list[Row]:
        path = run_dir / name
        if path.is_file():
            return _read_rows(path, required)
        if warn:  # a run killed early; the rest of the report still helps
            warnings.warn(f"{run_dir} has no {name}; its figures will be empty", stacklevel=3)
        return []

    samples = optional("samples.jsonl", ("step",), warn=True)
    timeline = optional("timeline.jsonl", ("kind", "start", "end"), warn=True)
    if any(finite(e["start"]) is None or finite(e["end"]) is None for e in timeline):
        raise ValueError(f"{run_dir / 'timeline.jsonl'} has an interval with a non-numeric start or end")
    errors = optional("errors.jsonl", ("exception",), warn=False)
    return Run(run_dir, config, metrics, samples, timeline, config_text, errors)
