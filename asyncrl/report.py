"""``asyncrl report RUN_DIR``: one self-contained HTML page about a training run.

Everything is computed from the files ``asyncrl train`` writes (``config.yaml``,
``metrics.jsonl``, ``samples.jsonl``, ``timeline.jsonl``), so a report can be made
after the fact, on another machine, for a run that was killed. The page embeds its
figures as base64 PNG data URIs (it can be mailed or archived as one file); the PNGs
are also written beside it for slides and diffs.
"""

from __future__ import annotations

import base64
import html
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

FIGURE_DPI = 110
ZOOM_MIN_STEPS = 16
"""Runs with more training steps than this also get a zoomed timeline (~10 steps)."""
ZOOM_STEPS = 10
MAX_GEN_LANES = 24
"""Generation sub-lanes; beyond this, intervals share lanes (drawn translucent)."""

LANE_COLORS = {"generate": "#4C78A8", "train": "#F58518", "sync": "#54A24B", "eval": "#B279A2"}


@dataclass
class Run:
    """The parsed contents of one training run directory."""

    run_dir: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    samples: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    config_text: str = ""

    @property
    def mode(self) -> str:
        return str(self.config.get("mode", "unknown"))

    @property
    def eta(self) -> int | None:
        """The staleness bound η the run enforced (mirrors ``Config.staleness``)."""
        mode = self.config.get("mode")
        if mode == "sync":
            return 0
        if mode == "one_step_off":
            return 1
        value = self.config.get("max_staleness")
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    @property
    def train_metrics(self) -> list[dict[str, Any]]:
        """Rows of optimizer steps (step ≥ 1); step 0 is the evaluation before training."""
        return [r for r in self.metrics if _num(r.get("step")) is not None and r["step"] >= 1]


# ---------------------------------------------------------------------------- loading


def _num(value: Any) -> float | None:
    """A finite number, or None (missing, NaN, bool, string): what a figure can plot."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _read_jsonl(path: Path, required: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Rows of a JSONL file. A broken *last* line is what a run killed mid-write leaves,
    so it is skipped with a warning; a broken line elsewhere means the file is not ours."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines):
                warnings.warn(f"{path}: skipping the truncated last line {lineno} (was the run killed "
                              f"mid-write?): {exc.msg}", stacklevel=3)
                break
            raise ValueError(f"{path} line {lineno} is not valid JSON ({exc.msg}): "
                             f"is it an asyncrl train output file?") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {lineno} holds a {type(row).__name__}, not a JSON object")
        missing = [k for k in required if k not in row]
        if missing:
            raise ValueError(f"{path} line {lineno} lacks {', '.join(map(repr, missing))}")
        rows.append(row)
    return rows


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

    config_path = run_dir / "config.yaml"
    config_text = config_path.read_text(encoding="utf-8", errors="replace")
    try:
        config = yaml.safe_load(config_text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{config_path} is not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a mapping of keys, got {type(config).__name__}")

    metrics_path = run_dir / "metrics.jsonl"
    metrics = _read_jsonl(metrics_path, required=("step",))
    if not metrics:
        raise ValueError(f"{metrics_path} has no rows: the run stopped before its first evaluation")
    if any(_num(r["step"]) is None for r in metrics):
        raise ValueError(f"{metrics_path} has a non-numeric 'step'")

    samples: list[dict[str, Any]] = []
    timeline: list[dict[str, Any]] = []
    for name in ("samples.jsonl", "timeline.jsonl"):
        if not (run_dir / name).is_file():  # a run killed early; the rest of the report still helps
            warnings.warn(f"{run_dir} has no {name}; its figures will be empty", stacklevel=2)
    if (run_dir / "samples.jsonl").is_file():
        samples = _read_jsonl(run_dir / "samples.jsonl", required=("step",))
    if (run_dir / "timeline.jsonl").is_file():
        timeline_path = run_dir / "timeline.jsonl"
        timeline = _read_jsonl(timeline_path, required=("kind", "start", "end"))
        if any(_num(r["start"]) is None or _num(r["end"]) is None for r in timeline):
            raise ValueError(f"{timeline_path} has an interval with a non-numeric start or end")
    return Run(run_dir, config, metrics, samples, timeline, config_text)


# ---------------------------------------------------------------------------- numbers


def staleness_values(run: Run) -> list[int]:
    """Versions between the weights a sample was generated with (its oldest token) and
    the weights it trained: what the η bound caps."""
    out = []
    for s in run.samples:
        trained, behavior = _num(s.get("trained_version")), _num(s.get("behavior_version_min"))
        if trained is not None and behavior is not None:
            out.append(int(trained - behavior))
    return out


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intervals(run: Run, kind: str) -> list[tuple[float, float]]:
    return [(float(e["start"]), float(e["end"])) for e in run.timeline if e.get("kind") == kind]


def overlap_fraction(run: Run) -> float | None:
    """Fraction of training time during which at least one generation was in flight: the
    point of async RL (sync mode scores ~0, a fully overlapped run ~1)."""
    train = _intervals(run, "train")
    total = sum(max(0.0, e - s) for s, e in train)
    if total <= 0:
        return None
    generating = _merge(_intervals(run, "generate"))
    covered = 0.0
    for ts, te in train:
        for gs, ge in generating:
            covered += max(0.0, min(te, ge) - max(ts, gs))
    return covered / total


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _column(rows: list[dict[str, Any]], key: str) -> list[float | None]:
    return [_num(r.get(key)) for r in rows]


def wall_time(run: Run) -> float | None:
    """Seconds from the start to the last recorded work (the final evaluation included)."""
    ends = [v for v in _column(run.train_metrics, "time/elapsed") if v is not None]
    ends += [float(e["end"]) for e in run.timeline]
    return max(ends) if ends else None


def summarize(run: Run) -> dict[str, Any]:
    """The headline numbers, keyed by their label in the report's table (insertion ordered)."""
    train = run.train_metrics
    evals = [r for r in run.metrics if _num(r.get("eval/reward_mean")) is not None]
    before = next((r for r in evals if r["step"] == 0), None)
    after = next((r for r in reversed(evals) if r["step"] > 0), None)
    stale = staleness_values(run)
    resumed = [bool(s.get("resumed")) for s in run.samples if "resumed" in s]
    eta = run.eta
    return {
        "mode": run.mode,
        "staleness bound η": eta,
        "steps": int(max(r["step"] for r in train)) if train else 0,
        "wall time (s)": wall_time(run),
        "eval reward before (step 0)": before and _num(before.get("eval/reward_mean")),
        "eval reward after (last eval)": after and _num(after.get("eval/reward_mean")),
        "eval pass@1 before": before and _num(before.get("eval/pass@1")),
        "eval pass@1 after": after and _num(after.get("eval/pass@1")),
        "last eval step": int(after["step"]) if after else None,
        "trained samples": len(run.samples),
        "mean samples/s": _mean(_column(train, "throughput/samples_per_s")),
        "mean tokens/s": _mean(_column(train, "throughput/tokens_per_s")),
        "mean trainer idle ratio": _mean(_column(train, "trainer/idle_ratio")),
        "mean rollout idle ratio": _mean(_column(train, "rollout/idle_ratio")),
        "staleness max": max(stale) if stale else None,
        "staleness mean": sum(stale) / len(stale) if stale else None,
        "samples beyond η": sum(v > eta for v in stale) if stale and eta is not None else None,
        "fraction resumed": sum(resumed) / len(resumed) if resumed else None,
        "train/generate overlap": overlap_fraction(run),
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


# ---------------------------------------------------------------------------- figures


def _figure(*args: Any, **kwargs: Any) -> Any:
    """A pyplot-free Figure: no global backend switch or state, so a library caller (or a
    thread) is unaffected; ``savefig`` renders with Agg."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:  # an optional dependency
        raise ImportError("asyncrl report needs matplotlib: pip install 'asyncrl[report]'") from exc
    return Figure(*args, **kwargs)


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center", transform=ax.transAxes,
            color="gray")


def _xy(rows: list[dict[str, Any]], x: str | Callable[[dict], float | None], y: str) -> tuple[list, list]:
    xs, ys = [], []
    for r in rows:
        xv = x(r) if callable(x) else _num(r.get(x))
        yv = _num(r.get(y))
        if xv is not None and yv is not None:
            xs.append(xv)
            ys.append(yv)
    return xs, ys


def _elapsed(row: dict[str, Any]) -> float | None:
    """Wall time of a metrics row: step 0 (before training) is at 0 s."""
    return 0.0 if row.get("step") == 0 else _num(row.get("time/elapsed"))


def plot_reward(run: Run, path: Path) -> Path:
    """Reward and eval scores against optimizer step and against wall time: an async run
    may be worse per step yet better per second, which only the pair shows."""
    fig = _figure(figsize=(12, 4.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    train = run.train_metrics
    for ax, x, xlabel in ((axes[0], "step", "optimizer step"), (axes[1], _elapsed, "wall time (s)")):
        plotted = False
        for key, label, style in (("reward/mean", "train reward (trained batch)", dict(lw=1.4)),
                                  ("rollout/reward_mean", "rollout reward (all generated)",
                                   dict(lw=1.0, alpha=0.7, ls="--"))):
            xs, ys = _xy(train, x, key)
            if xs:
                ax.plot(xs, ys, label=label, **style)
                plotted = True
        for key, label, marker in (("eval/reward_mean", "eval reward", "o"), ("eval/pass@1", "eval pass@1", "s")):
            xs, ys = _xy(run.metrics, x, key)
            if xs:
                ax.plot(xs, ys, marker=marker, ms=6, lw=1.2, label=label)
                plotted = True
        if not plotted:
            _no_data(ax, "rewards")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward / pass rate")
    axes[0].set_title("Reward by optimizer step")
    axes[1].set_title("Reward by wall time")
    if axes[0].get_legend_handles_labels()[0]:
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=4, fontsize=8)
    fig.suptitle(f"Reward ({run.mode})")
    fig.savefig(path, dpi=FIGURE_DPI)
    return path


def plot_staleness(run: Run, path: Path) -> Path:
    """How old the trained samples were, against the bound η: bars past the line are
    samples the staleness gate should have refused."""
    fig = _figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    values, eta = staleness_values(run), run.eta
    if values:
        top = max(max(values), (eta + 1) if eta is not None else 0)  # show the empty bar past η too
        bins = list(range(min(0, min(values)), top + 1))
        counts = [sum(v == b for v in values) for b in bins]
        ax.bar(bins, counts, width=0.8, color="#4C78A8", edgecolor="black", linewidth=0.5,
               label="trained trajectories")
        for b, c in zip(bins, counts):
            ax.annotate(str(c), (b, c), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                        textcoords="offset points")
        ax.set_xticks(bins)
        ax.set_xlim(bins[0] - 0.6, bins[-1] + 0.6)
    else:
        _no_data(ax, "samples")
    if eta is not None:
        ax.axvline(eta + 0.5, color="black", ls="--", lw=1.2, label=f"bound η = {eta}")
        ax.axvspan(eta + 0.5, max(ax.get_xlim()[1], eta + 1.1), color="#D62728", alpha=0.12,
                   label="beyond η (must be empty)")
    ax.set_xlabel("staleness (trained version − oldest behavior version)")
    ax.set_ylabel("trajectories")
    ax.set_title(f"Staleness of trained samples ({run.mode}, η = {eta if eta is not None else '?'})")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=FIGURE_DPI)
    return path


def _pack_lanes(intervals: list[tuple[float, float]], max_lanes: int) -> tuple[list[int], bool]:
    """Greedy first-fit lane per interval so concurrent generations sit side by side;
    past ``max_lanes``, an interval joins the lane that frees up first and overlaps
    (the second value says whether that happened)."""
    order = sorted(range(len(intervals)), key=lambda i: intervals[i])
    lane_end: list[float] = []
    lanes = [0] * len(intervals)
    shared = False
    for i in order:
        start, end = intervals[i]
        lane = next((k for k, e in enumerate(lane_end) if e <= start), None)
        if lane is None:
            if len(lane_end) < max_lanes:
                lane_end.append(end)
                lane = len(lane_end) - 1
            else:
                lane = min(range(len(lane_end)), key=lane_end.__getitem__)
                shared = True
        lane_end[lane] = max(lane_end[lane], end)
        lanes[i] = lane
    return lanes, shared


def in_flight(intervals: list[tuple[float, float]]) -> tuple[list[float], list[int]]:
    """Step function: number of intervals active from each time on."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda t: (t[0], t[1]))
    times, counts, active = [], [], 0
    for t, delta in events:
        active += delta
        times.append(t)
        counts.append(active)
    return times, counts


def zoom_window(run: Run, steps: int = ZOOM_STEPS) -> tuple[float, float] | None:
    """About ``steps`` training steps from the middle of a long run, in seconds; None for
    a run short enough that the full timeline already shows each step."""
    train = sorted(_intervals(run, "train"))
    if len(train) <= ZOOM_MIN_STEPS:
        return None
    first = len(train) // 2 - steps // 2
    last = first + steps - 1
    pad = 0.25 * (train[first][1] - train[first][0])
    return train[first][0] - pad, train[last][1] + pad


def plot_timeline(run: Run, path: Path, window: tuple[float, float] | None = None) -> Path:
    """Lanes of what ran when — generation (one bar per task group), training, weight
    sync, eval — and the groups in flight, so overlap of generation and training (or its
    absence in sync mode) can be seen rather than inferred."""
    fig = _figure(figsize=(13, 5.4), layout="constrained")
    ax, ax_count = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.2])
    gen = _intervals(run, "generate")
    lane_of, shared = _pack_lanes(gen, MAX_GEN_LANES)
    num_lanes = max(lane_of, default=0) + 1
    # rows (bottom to top): eval 0, sync 1, training 2, generation 3..4 (sub-lanes inside)
    lanes = [("eval", 0.0, 0.8), ("sync", 1.0, 0.8), ("train", 2.0, 0.8)]
    for kind, y, height in lanes:
        spans = [(s, e - s) for s, e in _intervals(run, kind)]
        if spans:
            ax.broken_barh(spans, (y, height), facecolors=LANE_COLORS[kind], edgecolor="black", linewidth=0.3)
    gen_y, gen_h = 3.0, 2.2
    sub_h = gen_h / num_lanes
    by_lane: dict[int, list[tuple[float, float]]] = {}
    for (s, e), lane in zip(gen, lane_of):
        by_lane.setdefault(lane, []).append((s, e - s))
    for lane, spans in by_lane.items():
        ax.broken_barh(spans, (gen_y + lane * sub_h, sub_h * 0.85), facecolors=LANE_COLORS["generate"],
                       alpha=0.5 if shared else 0.85, edgecolor="none")
    ax.set_yticks([0.4, 1.4, 2.4, gen_y + gen_h / 2], ["eval", "weight sync", "training",
                                                       f"generation\n({len(gen)} groups)"])
    ax.set_ylim(-0.2, gen_y + gen_h + 0.2)
    if window is not None:  # label the steps: they are wide enough to read
        for e in run.timeline:
            if e.get("kind") == "train" and window[0] <= e["start"] <= window[1]:
                ax.text((e["start"] + e["end"]) / 2, 2.4, str(e.get("step", "")), ha="center",
                        va="center", fontsize=7)
    ax.grid(axis="x", alpha=0.3)
    overlap = overlap_fraction(run)
    what = "zoom on the middle of the run" if window else "whole run"
    ax.set_title(f"Timeline ({what}; {run.mode}): training time overlapped by generation = "
                 f"{format_value(overlap)}")
    if not run.timeline:
        _no_data(ax, "timeline")
    times, counts = in_flight(gen)
    if times:
        ax_count.step(times, counts, where="post", color=LANE_COLORS["generate"])
        ax_count.fill_between(times, counts, step="post", alpha=0.3, color=LANE_COLORS["generate"])
    ax_count.set_ylabel("groups in\nflight")
    ax_count.set_xlabel("time since run start (s)")
    ax_count.grid(alpha=0.3)
    if window is not None:
        ax.set_xlim(*window)
    fig.savefig(path, dpi=FIGURE_DPI)
    return path


def plot_throughput(run: Run, path: Path) -> Path:
    """Throughput and who waited on whom: a high trainer idle ratio means generation is
    the bottleneck, a high rollout idle ratio means the staleness gate or training is."""
    fig = _figure(figsize=(12, 4.2), layout="constrained")
    ax_tp, ax_idle = fig.subplots(1, 2)
    train = run.train_metrics
    xs, ys = _xy(train, "step", "throughput/samples_per_s")
    handles = []
    if xs:
        handles += ax_tp.plot(xs, ys, color="#4C78A8", label="samples/s")
    ax_tp.set_ylabel("trained samples / s")
    ax_tok = ax_tp.twinx()
    xs, ys = _xy(train, "step", "throughput/tokens_per_s")
    if xs:
        handles += ax_tok.plot(xs, ys, color="#F58518", ls="--", label="tokens/s")
    ax_tok.set_ylabel("trained response tokens / s")
    if handles:
        ax_tp.legend(handles=handles, fontsize=8, loc="lower right")
    else:
        _no_data(ax_tp, "throughput")
    ax_tp.set_xlabel("optimizer step")
    ax_tp.set_title("Throughput")
    ax_tp.grid(alpha=0.3)
    plotted = False
    for key, label in (("trainer/idle_ratio", "trainer idle (waiting for samples)"),
                       ("rollout/idle_ratio", "rollout idle (engine not generating)")):
        xs, ys = _xy(train, "step", key)
        if xs:
            ax_idle.plot(xs, ys, marker=".", label=label)
            plotted = True
    if plotted:
        ax_idle.legend(fontsize=8)
    else:
        _no_data(ax_idle, "idle ratios")
    ax_idle.set_ylim(-0.03, 1.03)
    ax_idle.set_xlabel("optimizer step")
    ax_idle.set_ylabel("fraction of the step")
    ax_idle.set_title("Idle ratios")
    ax_idle.grid(alpha=0.3)
    fig.savefig(path, dpi=FIGURE_DPI)
    return path


# ---------------------------------------------------------------------------- page


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1300px; color: #222; }
h1 { font-size: 1.5em; word-break: break-all; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.8em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; }
"""


def _figures(run: Run, run_dir: Path) -> list[tuple[Path, str]]:
    figs = [
        (plot_reward(run, run_dir / "report_reward.png"),
         "Train and rollout reward, eval reward and pass@1, by step (left) and wall time (right)."),
        (plot_staleness(run, run_dir / "report_staleness.png"),
         "Staleness of every trained trajectory; the dashed line is the bound η."),
        (plot_timeline(run, run_dir / "report_timeline.png"),
         "What ran when: generation groups (packed in sub-lanes), training steps, weight syncs, "
         "evaluations; below, the number of groups being generated."),
    ]
    window = zoom_window(run)
    zoom = run_dir / "report_timeline_zoom.png"
    if window is not None:
        figs.append((plot_timeline(run, zoom, window),
                     f"The timeline zoomed on ~{ZOOM_STEPS} steps from the middle of the run."))
    elif zoom.exists():
        zoom.unlink()  # left from an earlier, longer report of this directory
    figs.append((plot_throughput(run, run_dir / "report_throughput.png"),
                 "Trained samples and tokens per second, and the idle ratio of trainer and rollout."))
    return figs


def write_report(run_dir: str | Path | Run) -> Path:
    """Write the figures (``report_*.png``) and ``report.html`` into the run directory;
    returns the HTML path. Takes a loaded ``Run`` too, so a caller can load (and report
    load errors) separately."""
    run = run_dir if isinstance(run_dir, Run) else load_run(run_dir)
    out = run.run_dir
    summary = summarize(run)
    esc = html.escape
    rows = "\n".join(f"<tr><th>{esc(k)}</th><td class=\"num\">{esc(format_value(v))}</td></tr>"
                     for k, v in summary.items())
    parts = []
    for png, caption in _figures(run, out):
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        parts.append(f'<figure><img src="data:image/png;base64,{data}" alt="{esc(png.stem)}">'
                     f"<figcaption>{esc(png.name)}: {esc(caption)}</figcaption></figure>")
    model = run.config.get("model", {})
    model_path = model.get("path") if isinstance(model, dict) else None
    title = f"asyncrl report: {run.run_dir} ({run.mode})"
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{esc(title)}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>{esc(title)}</h1>
<p>model: <code>{esc(str(model_path))}</code> &middot; mode: <code>{esc(run.mode)}</code>
&middot; partial_rollout: <code>{esc(str(run.config.get("partial_rollout")))}</code>
&middot; batch: <code>{esc(str(run.config.get("batch_size")))} groups &times;
{esc(str(run.config.get("group_size")))}</code></p>
<h2>Summary</h2>
<table>
{rows}
</table>
<h2>Figures</h2>
{chr(10).join(parts)}
<h2>Config</h2>
<pre>{esc(run.config_text)}</pre>
</body>
</html>
"""
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
