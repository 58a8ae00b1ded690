"""The report's numbers: the summary table, and the values figure titles quote.

Each is recomputed from the run's files rather than copied from one logged metric, so a
killed run, or one written before a metric existed, still gets every number it can.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from asyncrl.modes import trajectory_staleness
from asyncrl.report.run import Row, Run, evaluated_step, finite


def staleness_values(run: Run) -> list[int]:
    """The staleness of every trained sample with both versions logged: what η caps."""
    out = []
    for s in run.samples:
        trained, behavior = finite(s.get("trained_version")), finite(s.get("behavior_version_min"))
        if trained is not None and behavior is not None and s.get("response_tokens", 1):  # 0: no version (-1)
            out.append(trajectory_staleness(int(trained), int(behavior)))
    return out


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping intervals joined, so time covered twice is counted once."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap_fraction(run: Run) -> float | None:
    """Fraction of training time during which at least one generation was in flight: the
    point of async RL (sync mode scores ~0, a fully overlapped run ~1)."""
    train = run.intervals("train")
    total = sum(max(0.0, e - s) for s, e in train)
    if total <= 0:
        return None
    generating = merge_intervals(run.intervals("generate"))
    covered = 0.0
    for ts, te in train:
        for gs, ge in generating:
            covered += max(0.0, min(te, ge) - max(ts, gs))
    return covered / total


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _column(rows: list[Row], key: str) -> list[float | None]:
    return [finite(r.get(key)) for r in rows]


def wall_time(run: Run) -> float | None:
    """Seconds from the start to the last recorded work (the final evaluation included)."""
    ends = [v for v in _column(run.train_metrics, "time/elapsed") if v is not None]
    ends += [float(e["end"]) for e in run.timeline]
    return max(ends) if ends else None


def most_frequent_exception(run: Run) -> tuple[str, int] | None:
    """The exception that failed the most episode attempts, and how many: usually the one
    cause worth fixing first (a reward service down, a timeout)."""
    counts = Counter(str(e["exception"]) for e in run.errors)
    return counts.most_common(1)[0] if counts else None


def summarize(run: Run) -> dict[str, Any]:
    """The headline numbers, keyed by their label in the report's table (insertion ordered)."""
    train = run.train_metrics
    # by the version evaluated, not the row that logged it; the stable sort keeps log order for ties
    evaluated = [(step, r) for r in run.eval_metrics if (step := evaluated_step(r)) is not None]
    evaluated.sort(key=lambda e: e[0])
    before = next((r for step, r in evaluated if step == 0), None)
    last_step, after = next(((step, r) for step, r in reversed(evaluated) if step > 0), (None, None))
    stale = staleness_values(run)
    resumed = [bool(s.get("resumed")) for s in run.samples if "resumed" in s]
    eta = run.max_staleness
    common = most_frequent_exception(run)
    return {
        "mode": run.mode,
        "staleness bound η": eta,
        "steps": int(max(r["step"] for r in train)) if train else 0,
        "wall time (s)": wall_time(run),
        "eval reward before (step 0)": before and finite(before.get("eval/reward_mean")),
        "eval reward after (last eval)": after and finite(after.get("eval/reward_mean")),
        "eval pass@1 before": before and finite(before.get("eval/pass@1")),
        "eval pass@1 after": after and finite(after.get("eval/pass@1")),
        "last eval step": int(last_step) if last_step is not None else None,
        "trained samples": len(run.samples),
        "mean samples/s": _mean(_column(train, "throughput/samples_per_s")),
        "mean tokens/s": _mean(_column(train, "throughput/tokens_per_s")),
        "mean trainer idle ratio": _mean(_column(train, "trainer/idle_ratio")),
        "mean rollout idle ratio": _mean(_column(train, "rollout/idle_ratio")),
        "staleness max": max(stale) if stale else None,
        "staleness mean": sum(stale) / len(stale) if stale else None,
        "samples beyond η": sum(v > run.max_lag for v in stale) if stale and eta is not None else None,
        "fraction resumed": sum(resumed) / len(resumed) if resumed else None,
        "train/generate overlap": overlap_fraction(run),
        # a lower bound past ``logging.max_errors_per_step``: the trainer only counts the rest
        "failed episode attempts (in errors.jsonl)": len(run.errors),
        "most frequent exception": f"{common[0]} (×{common[1]})" if common else None,
        **drop_summary(run),
        **_agent_summary(train),
    }


DROPS = (  # why a generated group was not trained, and the counter (cumulative) that says how often
    ("filtered: every sample scored the same", "rollout/groups_filtered_total"),
    ("every episode failed", "rollout/groups_all_error_total"),
    ("stale: older than η when the learner came to it", "buffer/stale_dropped_total"),
)


def drop_summary(run: Run) -> dict[str, Any]:
    """Generated groups by what became of them, from the last step's counters: each reason
    for a drop with its share of the groups generated, the mean response length of the
    groups dropped as stale beside the trained ones' (the bias such drops make), the
    learner's waits that kept a group from going stale, the tasks the sampler passed over.
    A counter a run did not log (an older run) is left out."""
    last = run.train_metrics[-1] if run.train_metrics else {}

    def count(key: str) -> int | None:
        value = finite(last.get(key))
        return None if value is None else int(value)

    outcomes = [count(k) for k in ("rollout/groups_accepted_total", "rollout/groups_filtered_total",
                                   "rollout/groups_all_error_total")]
    if any(v is None for v in outcomes):
        return {}
    generated = sum(outcomes)
    out: dict[str, Any] = {"groups generated": generated}
    for reason, key in DROPS:
        n = count(key)
        if n is not None:
            out[f"groups dropped, {reason}"] = f"{n} ({n / generated:.1%})" if generated else str(n)
    saturated, hopeless = count("rollout/groups_saturated_total"), count("rollout/groups_hopeless_total")
    if saturated is not None and hopeless is not None:
        out["groups whose samples all scored the same: all solved / none solved"] = f"{saturated} / {hopeless}"
    tokens = [finite(s.get("response_tokens")) for s in run.samples]
    tokens = [t for t in tokens if t is not None]
    dropped = count("rollout/stale_dropped_trajectories_total")
    dropped_tokens = count("rollout/stale_dropped_tokens_total")
    if tokens or dropped:
        out["mean response tokens: trained / dropped as stale"] = (
            f"{format_value(sum(tokens) / len(tokens) if tokens else None)} / "
            f"{format_value(dropped_tokens / dropped if dropped and dropped_tokens is not None else None)}")
    for label, key in (("learner waits that kept a group from going stale", "rollout/deadline_waits_total"),
                       ("tasks passed over by the sampler", "rollout/sampler_skipped_total")):
        if (n := count(key)) is not None:
            out[label] = n
    return out


def _agent_summary(train: list[Row]) -> dict[str, Any]:
    """Agent rows, only for a run whose steps logged ``agent/*`` (multi-turn, agents)."""
    turns = _mean(_column(train, "agent/turns_mean"))
    if turns is None:
        return {}
    errors = [v for v in _column(train, "agent/tool_errors_total") if v is not None]
    return {
        "agent: mean turns per episode": turns,
        "agent: mean tool calls per episode": _mean(_column(train, "agent/tool_calls_mean")),
        "agent: tool errors (trained steps)": int(sum(errors)) if errors else None,
        "agent: mean tool latency per episode (s)": _mean(_column(train, "agent/tool_latency_s_mean")),
        "agent: mean fraction cut by the turn limit": _mean(_column(train, "agent/cut_by_turn_limit_fraction")),
    }


def format_value(value: Any) -> str:
    """How the summary table writes a number: floats to 3 decimals, missing as n/a."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
