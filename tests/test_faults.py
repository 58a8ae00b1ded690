"""Faults during a run: a reward function that raises is retried, dropped and counted;
a learner that fails stops the run with exit 1 and the last good checkpoint's path."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.algorithms.losses import policy_loss
from asyncrl.cli import main
from asyncrl.tasks import default_reward_fn

CALLS = {"loss": 0}


def flaky_reward(task, response: str) -> float:
    if len(response) % 3 == 0:
        raise ValueError("reward service unavailable")
    return default_reward_fn("countdown")(task, response)


def exploding_loss(*args, **kwargs):
    """The decoupled PPO loss, until the third optimizer step's micro-batch."""
    CALLS["loss"] += 1
    if CALLS["loss"] == 3:
        raise FloatingPointError("loss exploded on the learner")
    return policy_loss(*args, **kwargs)


def run(tmp_path, policy_dir, name, *extra):
    out = tmp_path / name
    code = main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "total_steps=4", "batch_size=2", "group_size=4", "eval.num_tasks=2", "eval.samples_per_task=1",
                 "eval_every=0", "task.num_train=64", "task.num_validation=4", "algorithm.filter_zero_variance=false",
                 "workflow.max_retries=1", *extra])
    return code, out


def test_failing_reward_is_retried_dropped_and_counted(tmp_path, policy_dir):
    code, out = run(tmp_path, policy_dir, "reward", "task.reward_fn=test_faults:flaky_reward")
    assert code == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert metrics[-1]["rollout/episodes_error_total"] > 0  # dropped, counted, and the run went on
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all(len(s["response"]) % 3 for s in samples)  # no errored episode was trained


def test_learner_failure_exits_1_naming_the_last_checkpoint(tmp_path, policy_dir, capsys):
    CALLS["loss"] = 0
    code, out = run(tmp_path, policy_dir, "learner", "algorithm.policy_loss=test_faults:exploding_loss",
                    "save_every=1")
    assert code == 1
    err = capsys.readouterr().err
    assert "loss exploded on the learner" in err
    assert f"last good checkpoint: {out / 'checkpoints' / 'step_2'}; continue from it with the same command and " \
        "resume=true" in err
    assert (out / "checkpoints" / "step_2" / "model.safetensors").exists()


def test_a_failure_before_any_checkpoint_says_there_is_nothing_to_resume_and_what_to_do(tmp_path, policy_dir, capsys):
    CALLS["loss"] = 0
    code, out = run(tmp_path, policy_dir, "early", "algorithm.policy_loss=test_faults:exploding_loss")
    assert code == 1
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert ("last good checkpoint: none yet, so there is nothing to resume: start the run again with a new "
            f"output_dir (or after removing {out})") in capsys.readouterr().err


@pytest.mark.parametrize("engine, saved, want", [
    ("remote", None, "interim"),  # a fleet, nothing saved yet: after the first step
    ("vllm", None, "interim"),  # vLLM's own processes: lost on their own too
    ("torch", None, None),  # in this process: the clock's saves alone
    ("remote", "step_1", None),  # one written (or resumed from) already
])
def test_a_run_whose_rollouts_live_outside_its_process_checkpoints_after_its_first_step(tmp_path, engine, saved, want):
    from pathlib import Path

    from asyncrl.config import load_config
    from asyncrl.orchestrator.run_checkpoints import RunCheckpoints

    cfg = load_config("examples/countdown/async.yaml", [f"engine={engine}", "remote.urls=[http://127.0.0.1:9]"])
    assert cfg.save_every == 0 and cfg.save_every_minutes > 0  # the defaults the lost fleet ran with
    checkpoints = RunCheckpoints(cfg, tmp_path, Path(tmp_path / saved) if saved else None)
    assert checkpoints.due(1) == want
    assert checkpoints.due(cfg.total_steps) is None  # the run's end saves anyway
    off = RunCheckpoints(cfg.model_copy(update={"save_every_minutes": 0.0}), tmp_path, None)
    assert off.due(1) is None  # periodic saves off: only the end


async def stuck_hook(event) -> None:
    """Announces itself, then hangs far beyond the test: a stop cannot finish the step."""
    open(os.environ["ASYNCRL_TEST_MARKER"], "a").close()
    await asyncio.sleep(600)


@pytest.mark.slow
def test_second_signal_stops_a_stuck_run(tmp_path, policy_dir):
    marker = tmp_path / "hook_called"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__), "ASYNCRL_TEST_MARKER": str(marker)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "train", "examples/countdown/async.yaml", f"model.path={policy_dir}",
         f"output_dir={tmp_path / 'stuck'}", "hooks.on_step_end=test_faults:stuck_hook", "eval.num_tasks=1",
         "eval.samples_per_task=1", "task.num_train=64", "task.num_validation=4", "batch_size=2", "group_size=4",
         "algorithm.filter_zero_variance=false"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    try:
        deadline = time.time() + 120
        while not marker.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), "the hook was never called"
        proc.send_signal(signal.SIGINT)  # first: finish the step — but the step's hook is stuck
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)  # second: stop waiting
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert b"stopped by a second signal" in err and b"last good checkpoint: none yet" in err


def test_errors_jsonl_is_capped_per_step_and_the_rest_counted(tmp_path, policy_dir):
    code, out = run(tmp_path, policy_dir, "capped", "task.reward_fn=test_faults:flaky_reward",
                    "logging.max_errors_per_step=1")
    assert code == 0
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    per_step = {}
    for e in errors:
        per_step[(e["step"])] = per_step.get(e["step"], 0) + 1
    assert errors and max(per_step.values()) == 1
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    # every failed attempt is either a line of errors.jsonl or counted as unlogged (1 retry a failed episode)
    assert last["rollout/errors_unlogged_total"] > 0
    assert len(errors) + last["rollout/errors_unlogged_total"] >= last["rollout/episodes_error_total"]
