"""``asyncrl report``: the page of a real (tiny) run is self-contained and shows that run's numbers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from asyncrl.cli import main  # noqa: E402
from asyncrl.report import Run, format_value, load_run, overlap_fraction, summarize, write_report  # noqa: E402
from asyncrl.tiny import build_char_tokenizer, build_tiny_model, save_tiny_policy  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOTAL_STEPS = 4


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One short real async run (random policy), shared by the tests of this module."""
    root = tmp_path_factory.mktemp("report")
    model, tokenizer = build_tiny_model(build_char_tokenizer(), seed=0)
    policy = save_tiny_policy(model, tokenizer, root / "policy")
    out = root / "run"
    assert main(["train", "examples/countdown/async.yaml", f"model.path={policy}", f"output_dir={out}",
                 f"total_steps={TOTAL_STEPS}", "batch_size=2", "group_size=4", "eval.num_tasks=4",
                 "eval.samples_per_task=1", "eval_every=2", "task.num_train=64", "task.num_validation=8",
                 "algorithm.filter_zero_variance=false", "sampling.max_tokens=12"]) == 0
    return out


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _row(label: str, value: str) -> str:
    return f'<tr><th>{label}</th><td class="num">{value}</td></tr>'


def _hand_written_run(root: Path, metrics: list[dict], timeline: list[dict] | None = None, mode: str = "async") -> Path:
    """A run directory written by hand: the files a report reads, with chosen contents."""
    root.mkdir()
    (root / "config.yaml").write_text(f"mode: {mode}\nmax_staleness: 3\n")
    for name, rows in (("metrics.jsonl", metrics), ("timeline.jsonl", timeline or []), ("samples.jsonl", [])):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_report_of_a_real_run(run_dir, capsys):
    capsys.readouterr()
    assert main(["report", str(run_dir)]) == 0
    html_path = run_dir / "report.html"
    assert capsys.readouterr().out.strip() == str(html_path)
    page = html_path.read_text()
    assert 'src="http' not in page and "<link" not in page and "<script" not in page
    assert page.count('src="data:image/png;base64,') >= 4
    pngs = sorted(run_dir.glob("report_*.png"))
    assert {p.name for p in pngs} >= {"report_reward.png", "report_staleness.png", "report_timeline.png",
                                      "report_throughput.png"}
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in pngs)

    # the numbers are this run's, recomputed here from its files
    metrics = _metrics(run_dir / "metrics.jsonl")
    last_eval = [r for r in metrics if r["step"] > 0 and "eval/reward_mean" in r][-1]
    assert last_eval["step"] == TOTAL_STEPS
    assert _row("eval reward after (last eval)", f"{last_eval['eval/reward_mean']:.3f}") in page
    assert _row("eval reward before (step 0)", f"{metrics[0]['eval/reward_mean']:.3f}") in page
    assert _row("steps", str(TOTAL_STEPS)) in page
    assert _row("mode", "async") in page and f"asyncrl report: {run_dir} (async)</h1>" in page
    samples = _metrics(run_dir / "samples.jsonl")
    assert _row("trained samples", str(len(samples))) in page and len(samples) == TOTAL_STEPS * 2 * 4
    stale = [s["trained_version"] - s["behavior_version_min"] for s in samples]
    assert _row("staleness max", str(max(stale))) in page and max(stale) <= 2
    mean_rate = sum(r["throughput/samples_per_s"] for r in metrics[1:]) / TOTAL_STEPS
    assert _row("mean samples/s", f"{mean_rate:.3f}") in page
    assert "max_staleness: 2" in page  # the config block

    summary = summarize(load_run(run_dir))
    assert summary["samples beyond η"] == 0
    assert 0.0 <= summary["train/generate overlap"] <= 1.0
    assert summary["mean samples/s"] == pytest.approx(mean_rate)


def test_missing_or_foreign_directory_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "run directory not found" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("mode: async\n")
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl, line 2" in capsys.readouterr().err


def test_truncated_last_line_still_reports(run_dir, tmp_path):
    """A run killed mid-write: its half-written last rows are skipped, the rest reported."""
    killed = tmp_path / "killed"
    shutil.copytree(run_dir, killed, ignore=shutil.ignore_patterns("checkpoints", "report*"))
    for name in ("metrics.jsonl", "timeline.jsonl"):
        text = (killed / name).read_text()
        (killed / name).write_text(text[: text.rstrip("\n").rfind("\n") + 1] + '{"step": 4, "rewa')
    with pytest.warns(UserWarning, match="truncated last line"):
        assert main(["report", str(killed)]) == 0
    page = (killed / "report.html").read_text()
    metrics = _metrics(run_dir / "metrics.jsonl")
    eval_2 = next(r for r in metrics if r["step"] == 2)
    assert _row("steps", str(TOTAL_STEPS - 1)) in page
    assert _row("eval reward after (last eval)", f"{eval_2['eval/reward_mean']:.3f}") in page


def test_overlap_fraction():
    def run(events):
        return Run(Path("."), {"mode": "async"}, [{"step": 0}], [], events)

    train = {"kind": "train", "start": 0.0, "end": 2.0}
    gens = [{"kind": "generate", "start": 1.0, "end": 1.5}, {"kind": "generate", "start": 1.2, "end": 3.0}]
    assert overlap_fraction(run([train, *gens])) == pytest.approx(0.5)
    assert overlap_fraction(run([train, {"kind": "generate", "start": 2.0, "end": 3.0}])) == 0.0
    assert overlap_fraction(run(gens)) is None
    assert format_value(None) == format_value(float("nan")) == "n/a"


def test_failed_attempts_are_summarised(tmp_path):
    """errors.jsonl is optional (silent when absent); when present, the table counts the failed
    attempts and names the most frequent exception."""
    run_dir = _hand_written_run(tmp_path / "run", [{"step": 0, "eval/reward_mean": 0.25},
                                                    {"step": 1, "time/elapsed": 1.0}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no errors.jsonl: nothing to warn about
        summary = summarize(load_run(run_dir))
    assert summary["failed episode attempts (in errors.jsonl)"] == 0 and summary["most frequent exception"] is None

    unavailable = "ValueError: reward service unavailable"
    errors = [{"step": 1, "phase": "train", "task_id": "t3", "attempt": a, "exception": unavailable,
               "traceback": "Traceback (most recent call last): ..."} for a in (1, 2)]
    errors.append({"step": 0, "phase": "eval", "task_id": "v1", "attempt": 1,
                   "exception": "TimeoutError: episode exceeded 30 s", "traceback": "..."})
    (run_dir / "errors.jsonl").write_text("".join(json.dumps(e) + "\n" for e in errors))
    summary = summarize(load_run(run_dir))
    assert summary["failed episode attempts (in errors.jsonl)"] == 3
    assert summary["most frequent exception"] == f"{unavailable} (×2)"
    page = write_report(run_dir).read_text()
    assert _row("failed episode attempts (in errors.jsonl)", "3") in page
    assert _row("most frequent exception", f"{unavailable} (×2)") in page

    (run_dir / "errors.jsonl").write_text('{"step": 1, "phase": "train"}\n')
    with pytest.raises(ValueError, match=r"errors.jsonl, line 1 lacks 'exception'"):
        load_run(run_dir)


def test_eval_concurrent_with_training(tmp_path):
    """Evaluation logged in a later row counts for the version it evaluated (``eval/version``), and
    eval intervals overlapping training still make a report."""
    metrics = [{"step": 0},
               {"step": 1, "time/elapsed": 1.0, "eval/version": 0, "eval/reward_mean": 0.1},
               {"step": 2, "time/elapsed": 2.0},
               {"step": 3, "time/elapsed": 3.0, "eval/version": 2, "eval/reward_mean": 0.6}]
    timeline = [{"kind": "eval", "start": 0.0, "end": 1.5}, {"kind": "train", "start": 0.2, "end": 1.0, "step": 1},
                {"kind": "train", "start": 1.2, "end": 2.0, "step": 2}, {"kind": "eval", "start": 2.0, "end": 3.2},
                {"kind": "train", "start": 2.2, "end": 3.0, "step": 3}]
    run = load_run(_hand_written_run(tmp_path / "run", metrics, timeline))
    summary = summarize(run)
    assert summary["eval reward before (step 0)"] == 0.1
    assert summary["eval reward after (last eval)"] == 0.6 and summary["last eval step"] == 2
    assert summary["wall time (s)"] == 3.2
    assert (write_report(run).parent / "report_timeline.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(("mode", "max_staleness"), [("sync", 0), ("one_step_off", 1), ("async", 3)])
def test_max_staleness_per_mode(tmp_path, mode, max_staleness):
    run = load_run(_hand_written_run(tmp_path / "run", [{"step": 0}], mode=mode))
    assert run.max_staleness == max_staleness == summarize(run)["staleness bound η"]


def test_without_matplotlib_a_run_still_loads_and_summarises(tmp_path):
    """matplotlib is optional: only drawing needs it, and ``asyncrl report`` says, in one
    line and exit 2, the install command that works in a clone."""
    run_dir = _hand_written_run(tmp_path / "run", [{"step": 0, "eval/reward_mean": 0.5}])
    code = f"""
import sys
sys.modules["matplotlib"] = None  # as if not installed
from asyncrl.report import load_run, summarize
from asyncrl.cli import main
assert summarize(load_run({str(run_dir)!r}))["eval reward before (step 0)"] == 0.5
sys.exit(main(["report", {str(run_dir)!r}]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == 'asyncrl report: asyncrl report needs matplotlib: pip install -e ".[report]"'
    assert not list(run_dir.glob("report*"))
