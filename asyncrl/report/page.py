"""``report.html``: one self-contained page, figures embedded as base64 PNG data URIs so
it can be mailed or archived as one file; the PNGs are also written beside it for slides
and diffs."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from asyncrl.report.doctor import diagnose
from asyncrl.report.figures import (
    has_agent_metrics,
    plot_agent,
    plot_reward,
    plot_staleness,
    plot_throughput,
    require_matplotlib,
)
from asyncrl.report.run import Run, load_run
from asyncrl.report.summary import format_value, summarize
from asyncrl.report.timeline import ZOOM_STEPS, plot_timeline, zoom_window

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
    """Draw every figure into ``run_dir``; (PNG, caption) in page order."""
    figs = [
        (plot_reward(run, run_dir / "report_reward.png"),
         ("Train and rollout reward, eval reward and pass@1 (at the version evaluated), by step (left) "
          "and wall time (right).")),
        (plot_staleness(run, run_dir / "report_staleness.png"),
         "Staleness of every trained trajectory; the dashed line is the bound η."),
        (plot_timeline(run, run_dir / "report_timeline.png"),
         ("What ran when: generation groups (packed in sub-lanes), training steps, weight syncs, "
          "evaluations (in their own lane, also while training runs); below, the number of groups "
          "being generated.")),
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
    agent = run_dir / "report_agent.png"
    if has_agent_metrics(run):
        figs.append((plot_agent(run, agent),
                     ("What the agent did per step: turns and tool calls per episode, tool errors, tool "
                      "latency, model tokens per turn, and the fraction of episodes cut by the turn limit.")))
    elif agent.exists():
        agent.unlink()  # left from an earlier report of this directory
    return figs


def write_report(run_dir: str | Path | Run) -> Path:
    """Write the figures (``report_*.png``) and ``report.html`` into the run directory;
    returns the HTML path. Takes a loaded ``Run`` too, so a caller can load (and report
    load errors) separately. Raises ImportError naming matplotlib, before writing
    anything, when it is not installed."""
    require_matplotlib()
    run = run_dir if isinstance(run_dir, Run) else load_run(run_dir)
    out = run.run_dir
    esc = html.escape
    rows = "\n".join(f"<tr><th>{esc(k)}</th><td class=\"num\">{esc(format_value(v))}</td></tr>"
                     for k, v in summarize(run).items())
    doctor = "\n".join(esc(line) for line in diagnose(run)[0][1:])
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
<h2>Doctor</h2>
<p>Every invariant of the run (<code>asyncrl doctor {esc(str(run.run_dir))}</code>): OK / WARN / FAIL, the first
step it broke, the evidence, the fix.</p>
<pre>{doctor}</pre>
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
