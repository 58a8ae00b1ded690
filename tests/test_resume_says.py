"""``resume=true`` says what it does: a finished run trains nothing, says so and leaves
every file as it was; a resume that changes settings names each (old → new) and records
the change in ``config_changes.jsonl`` beside ``config.yaml``, which stays as the run
began. Real ``asyncrl train`` processes on the shipped tiny policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl.config import (
    CONFIG_CHANGES_FILE,
    ConfigError,
    changed_settings,
    describe_changes,
    load_config,
    record_config_changes,
    run_settings,
    save_config,
)

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["model.path=models/countdown-tiny", "total_steps=3", "batch_size=2", "group_size=4", "eval.num_tasks=2",
         "eval.samples_per_task=1", "eval_every=0", "task.num_train=64", "task.num_validation=4",
         "algorithm.filter_zero_variance=false"]


def train(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", "examples/countdown/async.yaml", *SHORT,
                           f"output_dir={out}", *extra], check=False, capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def trained(out: Path) -> Path:
    done = train(out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def files(root: Path) -> dict[str, tuple[bytes, int] | None]:
    """Every file's bytes and mtime (ns), and every directory, under ``root``."""
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run of 3 steps, done. The tests that use it assert that they changed nothing."""
    return trained(tmp_path_factory.mktemp("finished") / "run")


@pytest.mark.slow
def test_resuming_a_finished_run_trains_nothing_says_so_and_writes_nothing(finished_run):
    before = files(finished_run)
    done = train(finished_run, "resume=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{finished_run} is finished: its latest checkpoint is step 3 of total_steps=3; nothing to train, " \
           "nothing written" in done.stderr
    assert "add total_steps=N with N > 3 to resume=true" in done.stderr
    assert "not applied" not in done.stderr  # the same settings: nothing else to say
    assert "resuming from" not in done.stderr and "train[" not in done.stderr  # no banner, no progress bar
    assert done.stdout.strip() == f"already finished; final checkpoint: {finished_run}/checkpoints/step_3"
    assert files(finished_run) == before


@pytest.mark.slow
def test_resuming_a_finished_run_with_other_settings_names_them_and_writes_nothing(finished_run):
    """A smaller total_steps is no reason to train either; what differs is said, not applied."""
    before = files(finished_run)
    done = train(finished_run, "resume=true", "total_steps=2", "save_every=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "its latest checkpoint is step 3, past total_steps=2; nothing to train, nothing written" in done.stderr
    assert "not applied, as nothing trains: total_steps 3 → 2, save_every 0 → 1" in done.stderr
    assert files(finished_run) == before


@pytest.mark.slow
def test_a_resume_that_changes_settings_says_which_and_records_them_beside_the_config(tmp_path):
    out = trained(tmp_path / "run")
    config = (out / "config.yaml").read_bytes()
    done = train(out, "resume=true", "total_steps=5", "optim.lr=1e-4")
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stderr.split("asyncrl: resuming with settings changed from the run's", 1)[1].splitlines()
    assert said[0] == f" (recorded in {out / CONFIG_CHANGES_FILE}; config.yaml keeps those it began with):"
    assert said[1:3] == ["  total_steps 3 → 5", "  optim.lr 0.0003 → 0.0001"]
    assert (out / "config.yaml").read_bytes() == config  # the original, resume: false and all
    rows = [json.loads(line) for line in (out / CONFIG_CHANGES_FILE).read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["resumed_from_step"] == 3
    assert rows[0]["changed"] == {"total_steps": {"old": 3, "new": 5}, "optim.lr": {"old": 0.0003, "new": 0.0001}}
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5]
    assert (out / "checkpoints" / "step_5").is_dir()

    # the same command again: the run last trained with these settings, so it is finished, and nothing differs
    before = files(out)
    again = train(out, "resume=true", "total_steps=5", "optim.lr=1e-4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step 5 of total_steps=5; nothing to train" in again.stderr and "not applied" not in again.stderr
    assert files(out) == before


# ------------------------------------------------------------- the comparison itself


def test_the_settings_a_run_last_trained_with_are_its_config_and_its_recorded_changes(tmp_path):
    cfg = load_config(ROOT / "examples/countdown/async.yaml", [f"output_dir={tmp_path}"])
    assert run_settings(tmp_path) is None  # no config.yaml: nothing to compare with
    save_config(cfg, tmp_path / "config.yaml")
    record_config_changes(tmp_path, 600, {"total_steps": (600, 800)})
    record_config_changes(tmp_path, 800, {"total_steps": (800, 900), "optim.lr": (0.0003, 0.0001)})
    saved = run_settings(tmp_path)
    assert saved["total_steps"] == 900 and saved["optim.lr"] == 0.0001 and saved["mode"] == "async"
    assert saved["optim.betas"] == [0.9, 0.99]  # as JSON holds it, so a tuple is no change
    assert changed_settings(saved, cfg) == {"total_steps": (900, 600), "optim.lr": (0.0001, 0.0003)}


def test_resume_and_the_same_output_dir_spelled_otherwise_are_no_change(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "examples/countdown/async.yaml", ["output_dir=runs/x"])
    save_config(cfg, tmp_path / "config.yaml")
    saved = run_settings(tmp_path)
    assert saved["resume"] is False
    same = cfg.model_copy(update={"resume": True, "output_dir": str(tmp_path / "runs" / "x")})
    assert changed_settings(saved, same) == {}
    moved = cfg.model_copy(update={"output_dir": "runs/y", "workflow": cfg.workflow.model_copy(
        update={"options": {"turns": 2}})})
    assert changed_settings(saved, moved) == {"output_dir": ("runs/x", "runs/y"),
                                              "workflow.options": ({}, {"turns": 2})}


def test_a_config_written_by_an_older_schema_is_compared_key_by_key(tmp_path):
    """A key the schema has since lost fails validation: the keys both know are compared."""
    data = yaml.safe_load((ROOT / "examples/countdown/async.yaml").read_text())
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**data, "retired_key": 1}))
    cfg = load_config(ROOT / "examples/countdown/async.yaml", ["total_steps=700"])
    assert changed_settings(run_settings(tmp_path), cfg) == {"total_steps": (600, 700)}
    (tmp_path / "config.yaml").write_text("mode: [async\n")
    with pytest.raises(ConfigError, match=r"config.yaml holds the run's settings but is not valid YAML"):
        run_settings(tmp_path)


def test_a_change_is_shown_old_to_new():
    assert describe_changes({"total_steps": (600, 800), "partial_rollout": ("abort", "continue"),
                             "logging.wandb": (False, True), "model.path": ("", "m")}) == [
        "total_steps 600 → 800", "partial_rollout abort → continue", "logging.wandb false → true",
        'model.path "" → m']
