"""The report's figures about learning and speed: reward, staleness, throughput, and
what agents did (turns, tools).

matplotlib is optional (``pip install 'asyncrl[report]'``): a run can be loaded and
summarised without it, and ``require_matplotlib`` fails before any file is written.
Figures are pyplot-free ``Figure`` objects: no global backend switch or state, so a
library caller (or a thread) is unaffected; ``savefig`` renders with Agg.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.report.run import Row, Run, evaluated_step, finite
from asyncrl.report.summary import staleness_values

try:
    from matplotlib.figure import Figure

    _MATPLOTLIB_MISSING: ImportError | None = None
except ImportError as exc:
    _MATPLOTLIB_MISSING = exc

FIGURE_DPI = 110


def require_matplotlib() -> None:
    """Raise an ImportError that says how to install matplotlib, when it is missing."""
    if _MATPLOTLIB_MISSING is not None:
        raise ImportError('asyncrl report needs matplotlib: pip install -e ".[report]"') from _MATPLOTLIB_MISSING


def new_figure(*args: Any, **kwargs: Any) -> Figure:
    require_matplotlib()
    return Figure(*args, **kwargs)


def mark_no_data(ax: Any, what: str) -> None:
    """Say so on an empty axis, rather than leave a blank frame that looks like a bug."""
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center", transform=ax.transAxes,
            color="gray")


XOf = Callable[[Row], float | None]
"""Where a metrics row sits on an x axis (None: not plotted)."""


def _points(rows: list[Row], x: XOf, y: str) -> tuple[list[float], list[float]]:
    """The rows where both ``x(row)`` and ``row[y]`` are finite numbers."""
    xs, ys = [], []
    for r in rows:
        xv, yv = x(r), finite(r.get(y))
        if xv is not None and yv is not None:
            xs.append(xv)
            ys.append(yv)
    return xs, ys


def _step(row: Row) -> float | None:
    return finite(row.get("step"))


def _elapsed(row: Row) -> float | None:
    """Wall time of a metrics row: step 0 (before training) is at 0 s."""
    return 0.0 if row.get("step") == 0 else finite(row.get("time/elapsed"))


def plot_reward(run: Run, path: Path) -> Path:
    """Reward and eval scores against optimizer step and against wall time: an async run
    may be worse per step yet better per second, which only the pair shows. An eval score
    sits at the version it evaluated (and at the time that version was trained), not at
    the later row that logged it when evaluation ran concurrently with training."""
    version_time = {0.0: 0.0}
    for r in run.train_metrics:
        if (t := finite(r.get("time/elapsed"))) is not None:
            version_time.setdefault(float(r["step"]), t)

    def eval_time(row: Row) -> float | None:
        step = evaluated_step(row)
        return version_time.get(step, _elapsed(row)) if step is not None else None

    fig = new_figure(figsize=(12, 4.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    panels = ((axes[0], _step, evaluated_step, "optimizer step"), (axes[1], _elapsed, eval_time, "wall time (s)"))
    for ax, train_x, eval_x, xlabel in panels:
        plotted = False
        for key, label, style in (("reward/mean", "train reward (trained batch)", {"lw": 1.4}),
                                  ("rollout/reward_mean", "rollout reward (all generated)",
                                   {"lw": 1.0, "alpha": 0.7, "ls": "--"})):
            xs, ys = _points(run.train_metrics, train_x, key)
            if xs:
                ax.plot(xs, ys, label=label, **style)
                plotted = True
        for key, label, marker in (("eval/reward_mean", "eval reward", "o"), ("eval/pass@1", "eval pass@1", "s")):
            points = sorted(zip(*_points(run.metrics, eval_x, key)))
            if points:
                ax.plot(*zip(*points), marker=marker, ms=6, lw=1.2, label=label)
                plotted = True
        if not plotted:
            mark_no_data(ax, "rewards")
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
    fig = new_figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    values, eta, lag = staleness_values(run), run.max_staleness, run.max_lag  # lag: ceil(η), the age bound
    if values:
        top = max(max(values), (lag + 1) if lag is not None else 0)  # show the empty bar past η too
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
        mark_no_data(ax, "samples")
    if lag is not None:
        bound = f"bound η = {eta}" if lag == eta else f"bound ceil(η = {eta}) = {lag}"
        ax.axvline(lag + 0.5, color="black", ls="--", lw=1.2, label=bound)
        ax.axvspan(lag + 0.5, max(ax.get_xlim()[1], lag + 1.1), color="#D62728", alpha=0.12,
                   label="beyond η (must be empty)")
    ax.set_xlabel("staleness (trained version − oldest behavior version)")
    ax.set_ylabel("trajectories")
    ax.set_title(f"Staleness of trained samples ({run.mode}, η = {eta if eta is not None else '?'})")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=FIGURE_DPI)
    return path


def plot_throughput(run: Run, path: Path) -> Path:
    """Throughput and who waited on whom: a high trainer idle ratio means generation is
    the bottleneck, a high rollout idle ratio means the staleness gate or training is."""
    fig = new_figure(figsize=(12, 4.2), layout="constrained")
    ax_tp, ax_idle = fig.subplots(1, 2)
    train = run.train_metrics
    xs, ys = _points(train, _step, "throughput/samples_per_s")
    handles = []
    if xs:
        handles += ax_tp.plot(xs, ys, color="#4C78A8", label="samples/s")
    ax_tp.set_ylabel("trained samples / s")
    ax_tok = ax_tp.twinx()
    xs, ys = _points(train, _step, "throughput/tokens_per_s")
    if xs:
        handles += ax_tok.plot(xs, ys, color="#F58518", ls="--", label="tokens/s")
    ax_tok.set_ylabel("trained response tokens / s")
    if handles:
        ax_tp.legend(handles=handles, fontsize=8, loc="lower right")
    else:
        mark_no_data(ax_tp, "throughput")
    ax_tp.set_xlabel("optimizer step")
    ax_tp.set_title("Throughput")
    ax_tp.grid(alpha=0.3)
    plotted = False
    for key, label in (("trainer/idle_ratio", "trainer idle (waiting for samples)"),
                       ("rollout/idle_ratio", "rollout idle (engine not generating)")):
        xs, ys = _points(train, _step, key)
        if xs:
            ax_idle.plot(xs, ys, marker=".", label=label)
            plotted = True
    if plotted:
        ax_idle.legend(fontsize=8)
    else:
        mark_no_data(ax_idle, "idle ratios")
    ax_idle.set_ylim(-0.03, 1.03)
    ax_idle.set_xlabel("optimizer step")
    ax_idle.set_ylabel("fraction of the step")
    ax_idle.set_title("Idle ratios")
    ax_idle.grid(alpha=0.3)
    fig.savefig(path, dpi=FIGURE_DPI)
    return path


AGENT_PANELS = (
    ("agent/turns_mean", "turns (model calls) per episode"),
    ("agent/tool_calls_mean", "tool calls per episode"),
    ("agent/tool_errors_total", "tool errors in the step"),
    ("agent/tool_latency_s_mean", "tool latency per episode (s)"),
    ("agent/tokens_per_turn_mean", "model tokens per turn"),
    ("agent/cut_by_turn_limit_fraction", "fraction cut by the turn limit"),
)
"""The ``agent/*`` keys of ``metrics.jsonl`` (multi-turn and agent runs), one panel each."""


def has_agent_metrics(run: Run) -> bool:
    return any(finite(r.get(key)) is not None for r in run.train_metrics for key, _ in AGENT_PANELS)


def plot_agent(run: Run, path: Path) -> Path:
    """What the agent did per optimizer step: more turns and tool calls as it learns to
    use its tools, errors and cut episodes as what to fix, latency and tokens per turn as
    where an episode's time goes."""
    fig = new_figure(figsize=(13, 6), layout="constrained")
    for ax, (key, title) in zip(fig.subplots(2, 3).flat, AGENT_PANELS):
        xs, ys = _points(run.train_metrics, _step, key)
        if xs:
            ax.plot(xs, ys, marker=".", lw=1.2)
        else:
            mark_no_data(ax, key)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"Agent diagnostics ({run.mode})")
    fig.savefig(path, dpi=FIGURE_DPI)
    return path
