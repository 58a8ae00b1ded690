"""``asyncrl doctor RUN_DIR``: every invariant of a run checked from its files, one line
each (``OK`` / ``WARN`` / ``FAIL`` / ``SKIP``, the first step it broke, the evidence, the
fix), then the run's health in numbers: where the time went and what was thrown away.

It reads what ``asyncrl train`` writes (``load_run``: a run that crashed or is still
running too, its torn last line skipped), so it can be run on a run in flight, after a
crash, or on another machine. The invariants themselves are pure functions over the rows,
shared with the live warnings of a run (``asyncrl/orchestrator/invariants.py``).

Exit status: 0 when every invariant holds (or has no evidence: ``SKIP``), 1 when the worst
finding is a ``WARN``, 2 for a ``FAIL`` (a directory that is not a run is a usage error,
also 2, with ``asyncrl: error:``).
"""

from __future__ import annotations

from asyncrl.orchestrator.invariants import Finding, check_run, worst
from asyncrl.report.run import Run, finite
from asyncrl.report.summary import (
    drop_summary,
    format_value,
    merge_intervals,
    most_frequent_exception,
    wall_time,
)

VERDICTS = {0: "OK", 1: "WARN", 2: "FAIL"}


def findings(run: Run) -> list[Finding]:
    """Every invariant's verdict on ``run``, in a fixed order."""
    return check_run(run.config, run.max_staleness, run.metrics, run.samples, run.errors)


def time_shares(run: Run) -> str | None:
    """Where the wall time went, from the timeline: the seconds the learner trained, the
    weights synced, evaluation ran and generation was in flight (any group), each as a
    share of the wall time (generation overlaps the others in async modes, so the shares
    need not add to 1), and the trainer's mean idle ratio (waiting for data)."""
    wall = wall_time(run)
    if not wall or not run.timeline:
        return None
    parts = []
    for label, kind in (("learner", "train"), ("weight sync", "sync"), ("eval", "eval"), ("generation", "generate")):
        seconds = sum(e - s for s, e in merge_intervals(run.intervals(kind)))
        parts.append(f"{label} {seconds:.1f} s ({seconds / wall:.0%})")
    idle = [v for r in run.train_metrics if (v := finite(r.get("trainer/idle_ratio"))) is not None]
    waited = f"; the trainer waited for data {sum(idle) / len(idle):.0%} of a step" if idle else ""
    return f"wall {wall:.1f} s: " + ", ".join(parts) + waited


def thrown_away(run: Run) -> str:
    """What was generated and not trained, and why (``drop_summary``'s counters), and the
    failed episode attempts."""
    drops = drop_summary(run)
    parts = [f"{k}: {format_value(v)}" for k, v in drops.items()
             if k.startswith(("groups generated", "groups dropped"))]
    common = most_frequent_exception(run)
    errors = f"{len(run.errors)} failed episode attempts logged" + (f" (most: {common[0]})" if common else "")
    return "; ".join([*parts, errors]) if parts else errors


def health(run: Run) -> list[str]:
    """The run's health in numbers, one line each."""
    train = run.train_metrics
    steps = int(max(r["step"] for r in train)) if train else 0
    lines = [f"steps trained: {steps} of {run.config.get('total_steps', '?')}; mode {run.mode}, η "
             f"{format_value(run.max_staleness)}; {len(run.samples)} trained samples"]
    if (shares := time_shares(run)) is not None:
        lines.append(f"time: {shares}")
    lines.append(f"thrown away: {thrown_away(run)}")
    tool_calls = [v for r in train if (v := finite(r.get("agent/tool_calls_mean"))) is not None]
    if tool_calls:
        lines.append(f"tool calls per episode: {sum(tool_calls) / len(tool_calls):.2f} (mean over steps)")
    return lines


def diagnose(run: Run) -> tuple[list[str], int]:
    """The doctor's lines (a header, one per invariant, the health numbers, the verdict) and
    its exit status."""
    found = findings(run)
    status = worst(found)
    lines = [f"asyncrl doctor {run.run_dir}", *(f.line() for f in found), "health:",
             *(f"  {line}" for line in health(run)),
             f"verdict: {VERDICTS[status]} (exit {status})"]
    return lines, status
