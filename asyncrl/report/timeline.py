"""The timeline figure: what ran when, so overlap of generation and training (or its
absence in sync mode) can be seen rather than inferred.

Each kind of work has its own lane, so work that runs at once never hides other work:
evaluation concurrent with training sits in the eval lane under the training bars, and
concurrent generations are packed into sub-lanes of the generation lane.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.report.figures import FIGURE_DPI, mark_no_data, new_figure
from asyncrl.report.run import Run
from asyncrl.report.summary import format_value, overlap_fraction

ZOOM_MIN_STEPS = 16
"""Runs with more training steps than this also get a zoomed timeline (~10 steps)."""
ZOOM_STEPS = 10
MAX_GEN_LANES = 24
"""Generation sub-lanes; beyond this, intervals share lanes (drawn translucent)."""

LANE_COLORS = {"generate": "#4C78A8", "train": "#F58518", "sync": "#54A24B", "eval": "#B279A2"}


def pack_lanes(intervals: list[tuple[float, float]], max_lanes: int) -> tuple[list[int], bool]:
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
    train = sorted(run.intervals("train"))
    if len(train) <= ZOOM_MIN_STEPS:
        return None
    first = len(train) // 2 - steps // 2
    last = first + steps - 1
    pad = 0.25 * (train[first][1] - train[first][0])
    return train[first][0] - pad, train[last][1] + pad


def plot_timeline(run: Run, path: Path, window: tuple[float, float] | None = None) -> Path:
    """Lanes of generation (one bar per task group), training, weight sync and eval, and
    below them the number of groups in flight."""
    fig = new_figure(figsize=(13, 5.4), layout="constrained")
    ax, ax_count = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.2])
    gen = run.intervals("generate")
    lane_of, shared = pack_lanes(gen, MAX_GEN_LANES)
    num_lanes = max(lane_of, default=0) + 1
    # rows (bottom to top): eval 0, sync 1, training 2, generation 3..5.2 (sub-lanes inside)
    for kind, y in (("eval", 0.0), ("sync", 1.0), ("train", 2.0)):
        spans = [(s, e - s) for s, e in run.intervals(kind)]
        if spans:
            ax.broken_barh(spans, (y, 0.8), facecolors=LANE_COLORS[kind], edgecolor="black", linewidth=0.3)
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
    what = "zoom on the middle of the run" if window else "whole run"
    ax.set_title(f"Timeline ({what}; {run.mode}): training time overlapped by generation = "
                 f"{format_value(overlap_fraction(run))}")
    if not run.timeline:
        mark_no_data(ax, "timeline")
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
