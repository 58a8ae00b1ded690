"""Crash-safe checkpoints and ``resume=true``: a run killed with SIGKILL between two
checkpoints and resumed describes one consistent history."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.orchestrator.checkpoint import (
    RunState,
    clear_unfinished,
    is_interim,
    latest_checkpoint,
    mark_kept,
    rollback_logs,
    rotate,
    save_due,
    starting_point,
)
from asyncrl.orchestrator.task_stream import Draw, TaskStream
from asyncrl.rollout.workflows.registry import build_tasks


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_task_stream_reissues_first_then_continues_the_epoch():
    tasks = list(range(10))
    full = TaskStream(tasks, seed=3)
    order = [full.next_index() for _ in range(10)]
    assert sorted(order) == tasks
    # handed out 0..5; the tasks at positions 2 and 4 never finished before the crash
    resumed = TaskStream(tasks, seed=3, epoch=0, index=6, reissue=[Draw(order[2], 0), Draw(order[4], 0)])
    rest = [resumed.next_index() for _ in range(6)]
    assert rest == [order[2], order[4], *order[6:]]
    assert resumed.next_index() in tasks and resumed.epoch == 1


def test_run_state_saves_each_reissued_draw_whole():
    state = RunState(step=2, elapsed_s=5.0, started=6, epoch=1, index=3, reissue=[Draw(4, 0, 5), Draw(7, 1)],
                     buffered=[])
    assert json.loads(state.to_json())["reissue"] == [{"index": 4, "epoch": 0, "order": 5},
                                                      {"index": 7, "epoch": 1, "order": None}]
    assert RunState.from_json(state.to_json()) == state


def test_an_older_run_state_loads_its_reissued_tasks_as_draws():
    """Checkpoints written before draws were saved whole: task indices with their epochs and
    start orders in lists beside them, or (older) without them; an entry the lists do not
    cover was drawn in the cursor's epoch and starts afresh."""
    old = {"step": 2, "elapsed_s": 5.0, "started": 6, "epoch": 1, "index": 3, "buffered": [], "counters": {},
           "stale_dropped": 0}
    with_lists = RunState.from_json(json.dumps({**old, "reissue": [4, 7, 9], "reissue_epochs": [0, 1],
                                                "reissue_orders": [5]}))
    assert with_lists.reissue == [Draw(4, 0, 5), Draw(7, 1, None), Draw(9, 1, None)]
    assert not hasattr(with_lists, "reissue_epochs") and not hasattr(with_lists, "reissue_orders")
    without = RunState.from_json(json.dumps({**old, "reissue": [4, 7]}))
    assert without.reissue == [Draw(4, 1, None), Draw(7, 1, None)]
    assert json.loads(without.to_json())["reissue"][0] == {"index": 4, "epoch": 1, "order": None}


def test_latest_checkpoint_ignores_half_written(tmp_path):
    for step in (2, 4):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "trainer_state.pt").write_bytes(b"x")
        (tmp_path / f"step_{step}" / "run_state.json").write_text("{}")
    (tmp_path / "step_6.tmp").mkdir()  # a crash while writing step 6
    (tmp_path / "step_8").mkdir()  # weights without state: not a checkpoint
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4"


def test_a_resume_clears_what_a_crash_mid_save_left(tmp_path, capsys, monkeypatch):
    # placeholder files stand for checkpoints here: reading them back is test_fault_matrix's subject
    monkeypatch.setattr("asyncrl.orchestrator.checkpoint.damage", lambda checkpoint: None)
    ckpt = tmp_path / "checkpoints"
    for name in ("step_2", "step_4.old", "step_6.tmp", "step_2.old"):
        (ckpt / name).mkdir(parents=True)
        (ckpt / name / "trainer_state.pt").write_bytes(b"x")
        (ckpt / name / "run_state.json").write_text("{}")
    # step_4 was set aside and its replacement never renamed in: step_4.old is the good copy
    assert starting_point(tmp_path, resume=True) == ckpt / "step_4"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2", "step_4"]
    err = capsys.readouterr().err
    assert "removed" in err and "step_6.tmp" in err and "restored" in err and "step_4.old" in err
    assert clear_unfinished(ckpt) == []  # nothing left to tidy


def test_a_checkpoint_is_due_by_steps_or_by_wall_time():
    # (step, total_steps, save_every, save_every_minutes, seconds since the last save) -> kind
    assert save_due(4, 10, 2, 10.0, 0.0) == "kept"
    assert save_due(4, 10, 2, 10.0, 601.0) == "kept"  # both due: the step's, kept
    assert save_due(3, 10, 2, 10.0, 599.0) is None
    assert save_due(3, 10, 2, 10.0, 600.0) == "interim"
    assert save_due(3, 10, 0, 0.5, 30.0) == "interim"
    assert save_due(3, 10, 0, 0.0, 1e9) is None  # both off: only the run's end saves
    assert save_due(10, 10, 2, 10.0, 1e9) is None  # the last step's checkpoint is the run's end's


def fake_checkpoint(ckpt: Path, step: int, interim: bool) -> Path:
    path = ckpt / f"step_{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.pt").write_bytes(b"x")
    state = RunState(step=step, elapsed_s=0.0, started=0, epoch=0, index=0, reissue=[], buffered=[], interim=interim)
    (path / "run_state.json").write_text(state.to_json())
    return path


def test_an_interim_checkpoint_goes_once_a_later_one_is_written_and_pushes_no_kept_one_out(tmp_path):
    ckpt = tmp_path / "checkpoints"

    def names() -> list[str]:
        return sorted((p.name for p in ckpt.iterdir()), key=lambda n: int(n[5:]))

    fake_checkpoint(ckpt, 10, interim=False)
    rotate(ckpt, keep_last=1, newest=fake_checkpoint(ckpt, 13, interim=True))
    assert names() == ["step_10", "step_13"]  # keep_last=1 counts kept ones: step_10 stays
    rotate(ckpt, keep_last=1, newest=fake_checkpoint(ckpt, 17, interim=True))
    assert names() == ["step_10", "step_17"]
    rotate(ckpt, keep_last=1, newest=fake_checkpoint(ckpt, 20, interim=False))
    assert names() == ["step_20"]
    newest = fake_checkpoint(ckpt, 22, interim=True)
    mark_kept(newest)  # the run ended (or a hook saved) at the interim checkpoint's step
    assert not is_interim(newest) and RunState.from_json((newest / "run_state.json").read_text()).step == 22
    rotate(ckpt, keep_last=2, newest=fake_checkpoint(ckpt, 25, interim=True))
    assert names() == ["step_20", "step_22", "step_25"]


def test_rollback_drops_rows_after_the_checkpoint_and_a_torn_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5))
                                            + '{"step": 5, "rew')
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 3)))
    (tmp_path / "timeline.jsonl").write_text(json.dumps({"end": 1.0}) + "\n" + json.dumps({"end": 9.0}) + "\n")
    (tmp_path / "errors.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 3)))
    (tmp_path / "eval_samples.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 0, 2, 4, 4)))
    state = RunState(step=2, elapsed_s=5.0, started=0, epoch=0, index=0, reissue=[], buffered=[])
    assert rollback_logs(tmp_path, state) == {"metrics.jsonl": 3, "samples.jsonl": 2, "timeline.jsonl": 1,
                                              "errors.jsonl": 1, "eval_samples.jsonl": 2}
    assert [r["step"] for r in read_jsonl(tmp_path / "eval_samples.jsonl")] == [0, 0, 2]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert [r["step"] for r in read_jsonl(tmp_path / "samples.jsonl")] == [1, 2]


def slow_reward(task, response: str) -> float:
    """Slower than a train step: with η = 3 the groups started at the last sync are still
    in flight when the next checkpoint is taken."""
    time.sleep(0.5)
    return float(len(response) % 2)


def run_args(policy_dir, out, *extra):
    return [sys.executable, "-m", "asyncrl.cli", "train", "examples/countdown/async.yaml", f"model.path={policy_dir}",
            f"output_dir={out}", "mode=async", "max_staleness=3", "partial_rollout=abort", "total_steps=10",
            "save_every=3",
            "keep_last=2", "batch_size=2", "group_size=4", "eval.num_tasks=2", "eval.samples_per_task=1",
            "eval_every=0", "task.num_train=64", "task.num_validation=4", "algorithm.filter_zero_variance=false",
            "task.reward_fn=test_resume:slow_reward", *extra]


@pytest.mark.slow
def test_kill_9_between_checkpoints_then_resume(tmp_path, policy_dir):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(__file__)}
    proc = subprocess.Popen(run_args(policy_dir, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    metrics_file, deadline = out / "metrics.jsonl", time.time() + 180
    # kill as soon as step 4 is logged: the checkpoint of step 3 exists, step 6's does not
    while time.time() < deadline and proc.poll() is None:
        if metrics_file.exists() and any(r.get("step") == 4 for r in read_jsonl_safe(metrics_file)):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    checkpoint = latest_checkpoint(out / "checkpoints")  # step_3, unless this machine lagged the kill
    assert checkpoint is not None
    c = int(checkpoint.name[5:])
    before = RunState.from_json((checkpoint / "run_state.json").read_text())
    saved = shutil.copytree(checkpoint, tmp_path / "saved_checkpoint")  # rotation deletes it later
    metrics_before = read_jsonl_safe(metrics_file)
    samples_before = read_jsonl_safe(out / "samples.jsonl")
    assert max(r["step"] for r in metrics_before) > c, "the kill must leave work past the checkpoint"
    assert before.reissue, "generation is slower than training here: groups should be in flight at the checkpoint"

    done = subprocess.run(run_args(policy_dir, out, "resume=true"), capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert b"resuming from" in done.stderr

    metrics = read_jsonl(metrics_file)
    samples = read_jsonl(out / "samples.jsonl")
    # one history: every step once, versions without a gap
    assert [m["step"] for m in metrics] == list(range(11))
    assert [m["version"] for m in metrics] == list(range(11))
    assert Counter(s["step"] for s in samples) == {step: 2 * 4 for step in range(1, 11)}
    # nothing trained twice: each (group, episode) appears once
    keys = [(s["group"], s["episode"]) for s in samples]
    assert len(keys) == len(set(keys))
    # the history up to the checkpoint is what was there before the crash
    assert [s for s in samples if s["step"] <= c] == [s for s in samples_before if s["step"] <= c]
    # nothing generated before the checkpoint is lost: its buffered groups were trained after it
    trained_groups = {s["group"]: s["step"] for s in samples}
    for g in before.buffered:
        assert trained_groups.get(g["start_order"], 0) > c, g["start_order"]
    # the checkpoint's weights and optimizer carried on: version continues from c
    assert torch.load(saved / "trainer_state.pt", weights_only=False)["version"] == c
    final = latest_checkpoint(out / "checkpoints")
    assert final.name == "step_10"
    assert torch.load(final / "trainer_state.pt", weights_only=False)["version"] == 10
    # every task handed out in this epoch is trained once, or still pending at the end, or dropped as stale
    after = RunState.from_json((final / "run_state.json").read_text())
    assert after.epoch == 0
    cfg = load_config("examples/countdown/async.yaml", ["task.num_train=64", "task.num_validation=4"])
    ids = [t.id for t in build_tasks(cfg).train]
    stream = TaskStream(ids, cfg.seed)
    handed_out = Counter(ids[stream.next_index()] for _ in range(after.index))
    trained = Counter(s["task_id"] for s in samples if s["episode"] == 0)
    pending = Counter([ids[d.index] for d in after.reissue] + [g["group"]["task_id"] for g in after.buffered])
    assert max((trained + pending).values()) == 1
    assert not (trained + pending) - handed_out
    assert sum(handed_out.values()) - sum((trained + pending).values()) == metrics[-1]["buffer/stale_dropped_total"]


def read_jsonl_safe(path):
    """Rows of a file another process may be writing: a torn last line is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


@pytest.mark.slow
def test_a_run_with_the_default_checkpoints_killed_after_its_first_resumes(tmp_path, policy_dir):
    """Nothing set about saving but ``save_every_minutes``, shortened (0.6 s): the default's
    interim checkpoint is there to resume from after a SIGKILL, the resumed run finishes
    with every step once, and the interim checkpoints are gone once the final one is written."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "asyncrl.cli", "train", "examples/countdown/async.yaml", f"model.path={policy_dir}",
            f"output_dir={out}", "total_steps=40", "batch_size=2", "group_size=2", "eval_every=0",
            "eval.num_tasks=2", "eval.samples_per_task=1", "task.num_train=64", "task.num_validation=4",
            "sampling.max_tokens=8", "algorithm.filter_zero_variance=false", "save_every_minutes=0.01"]
    cfg = load_config("examples/countdown/async.yaml", [])
    assert cfg.save_every == 0 and cfg.save_every_minutes > 0  # the example as shipped: by time only
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and latest_checkpoint(out / "checkpoints") is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    checkpoint = latest_checkpoint(out / "checkpoints")
    assert checkpoint is not None and is_interim(checkpoint)
    killed_at = int(checkpoint.name[5:])
    assert killed_at < 40

    done = subprocess.run([*args, "resume=true"], capture_output=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert f"resuming from {checkpoint}".encode() in done.stderr
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(41))
    assert Counter(s["step"] for s in read_jsonl(out / "samples.jsonl")) == {step: 2 * 2 for step in range(1, 41)}
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_40"]
