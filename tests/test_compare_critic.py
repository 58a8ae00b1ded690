"""examples/countdown/compare_critic.py: the table it prints from finished runs (no training
here: run directories written by hand, the numbers worked out below), and its refusals."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "countdown" / "compare_critic.py"


def _script():
    spec = importlib.util.spec_from_file_location("compare_critic", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(path: Path, start: float, end: float, pass1: float, accepted: int, filtered: int, steps: int = 4) -> None:
    """A finished run: evaluated at step 0 and at ``steps``, ``accepted`` + ``filtered`` groups made."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("mode: async\nmax_staleness: 2\n")
    for empty in ("samples.jsonl", "timeline.jsonl"):
        (path / empty).write_text("")
    rows = [{"step": 0, "eval/reward_mean": start, "eval/pass@1": 0.1, "eval/version": 0}]
    counters = {"rollout/groups_accepted_total": accepted, "rollout/groups_filtered_total": filtered,
                "rollout/groups_all_error_total": 0}
    rows += [{"step": s, "time/elapsed": 30.0 * s, **counters} for s in range(1, steps + 1)]
    rows[-1].update({"eval/reward_mean": end, "eval/pass@1": pass1, "eval/version": steps})  # the last step's row
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_table_of_finished_runs_by_hand(tmp_path, capsys):
    script = _script()
    for seed, (grpo, ppo) in enumerate([(0.40, 0.30), (0.50, 0.36)]):
        _run(script.run_dir(tmp_path, "GRPO", seed), 0.2, grpo, grpo - 0.1, accepted=32, filtered=96)
        _run(script.run_dir(tmp_path, "PPO+GAE", seed), 0.2, ppo, ppo - 0.1, accepted=34, filtered=0)
    assert script.main(["--steps", "4", "--seeds", "0", "1", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "held-out reward after 4 steps"
    # mean of 0.40 and 0.50; pass@1 mean of 0.30 and 0.40; 8 × 8 trained; (32 + 96) groups × 8 / 4 steps
    # generated; the last step's time/elapsed, 120 s, is 2.0 minutes
    assert "| GRPO | 0.200 | 0.400 | 0.500 | **0.450** | 0.350 | 64 | 256 | 2.0 |" in lines
    assert "| PPO+GAE | 0.200 | 0.300 | 0.360 | **0.330** | 0.230 | 64 | 68 | 2.0 |" in lines


def test_an_unfinished_run_is_refused_and_nothing_is_overwritten(tmp_path):
    script = _script()
    _run(script.run_dir(tmp_path, "GRPO", 0), 0.2, 0.4, 0.3, accepted=8, filtered=0, steps=2)
    with pytest.raises(SystemExit, match="grpo-s0 holds an unfinished or different run; delete it"):
        script.main(["--steps", "4", "--seeds", "0", "--arms", "GRPO", "--out", str(tmp_path)])
    assert "eval/version\": 2" in (script.run_dir(tmp_path, "GRPO", 0) / "metrics.jsonl").read_text()


def test_arms_that_train_different_samples_per_step_are_refused_before_anything_runs(tmp_path, monkeypatch):
    script = _script()
    assert script.samples_per_step(["batch_size=4"]) == 32  # the overrides go to both arms
    fewer = tmp_path / "ppo.yaml"
    fewer.write_text(script.ARMS["PPO+GAE"].read_text().replace("group_size: 8", "group_size: 4"))
    monkeypatch.setitem(script.ARMS, "PPO+GAE", fewer)
    with pytest.raises(SystemExit, match=r"^the arms train different samples per step \(GRPO 8 × 8, PPO\+GAE 8 × 4\)"):
        script.main(["--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
