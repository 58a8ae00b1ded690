"""On-policy distillation end to end: the addition policy trains with a teacher served by
`asyncrl serve-engine`, `distill/reverse_kl` in its rows; a teacher that is down before the run
is refused before any work, and one that goes away mid-run stops the run naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from test_remote_engine import ROOT, ServeEngine

from asyncrl.cli import main

ADDITION = str(ROOT / "examples/addition/async.yaml")
SMALL = ["total_steps=6", "eval_every=0", "eval.num_tasks=8", "eval.samples_per_task=2", "save_every_minutes=0"]


@pytest.mark.slow
def test_a_run_distils_from_a_served_teacher_and_a_teacher_that_goes_away_is_named(tmp_path, capsys):
    teacher = ServeEngine(ADDITION)
    try:
        out = tmp_path / "distil"
        assert main(["train", ADDITION, f"output_dir={out}", f"teacher.url={teacher.url}", "teacher.coef=0.5",
                     *SMALL]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        kl = [r["distill/reverse_kl"] for r in rows if "reward/mean" in r]
        assert len(kl) == 6 and all(abs(x) < 5 for x in kl)  # the teacher is the student's start: near 0
        samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert samples and all(s["reward"] in (0.0, 1.0) for s in samples)

        # the teacher goes away mid-run: groups fail, counted, and the run stops naming it (exit 1)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        run = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "train", ADDITION,
                                f"output_dir={tmp_path / 'orphan'}", f"teacher.url={teacher.url}", "teacher.retries=0",
                                "teacher.timeout_s=5", "total_steps=100000", "eval_every=0", "save_every_minutes=0"],
                               cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        try:
            metrics = tmp_path / "orphan" / "metrics.jsonl"
            deadline = time.monotonic() + 300
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
                assert run.poll() is None and time.monotonic() < deadline, "the distilling run made no steps"
                time.sleep(0.2)
            teacher.kill()
            _, err = run.communicate(timeout=300)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait(30)
        assert run.returncode == 1, err[-2000:]
        assert f"the teacher at {teacher.url}" in err and "groups in a row" in err
    finally:
        teacher.stop()
    capsys.readouterr()
    # a teacher that does not answer at all is refused before any work (exit 2), naming it
    assert main(["train", ADDITION, f"output_dir={tmp_path / 'none'}", f"teacher.url={teacher.url}",
                 "teacher.retries=0", "teacher.timeout_s=5", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "teacher.url:" in err and f"the teacher at {teacher.url}" in err
    assert not (tmp_path / "none" / "metrics.jsonl").exists()
