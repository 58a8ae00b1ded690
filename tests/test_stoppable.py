"""Every run can be stopped: blocking user code (a synchronous agent, a reward function)
that never returns is abandoned on a daemon thread of the run's own pool, so it neither
keeps its slot, nor hides from the watchdog, nor keeps the process from exiting on
Ctrl-C or SIGTERM; the exit says what was left running. Real processes, because what is
tested is how the interpreter exits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.threads import UserThreads, call_in_thread, stuck_report

TESTS = os.path.dirname(__file__)
HANG_S = 3600


def _announce() -> None:
    marker = os.environ.get("ASYNCRL_TEST_MARKER")
    if marker:
        open(marker, "a").close()


def hang_forever(task, base_url: str) -> float:
    """A synchronous agent that announces itself, then never returns."""
    _announce()
    time.sleep(HANG_S)
    return 0.0


def hang_reward(task, response: str) -> float:
    """A reward function that announces itself, then never returns."""
    _announce()
    time.sleep(HANG_S)
    return 0.0


def test_a_timed_out_call_frees_its_slot_and_is_tracked():
    release = threading.Event()

    def stuck(task_id: str) -> str:
        release.wait()
        return task_id

    async def main(pool: UserThreads) -> None:
        with pytest.raises(TimeoutError):
            await pool.call(stuck, "t1", what="agent tests:stuck", task_id="t1", timeout_s=0.5)
        # the one slot is free again: a new thread serves the next call while the first is stuck
        assert await pool.call(lambda: "ok", what="agent tests:quick", timeout_s=5) == "ok"
        with pool.current():  # what an episode of the rollout worker runs under
            assert await call_in_thread(str.upper, "x", timeout_s=5) == "X"

    pool = UserThreads(1, name="test-user")
    asyncio.run(main(pool))
    assert pool.abandoned_total == 1 and pool.abandoned_now == 1
    (call,) = pool.in_user_code()
    assert (call.what, call.task_id, call.state) == ("agent tests:stuck", "t1", "abandoned")
    assert call.thread.daemon and "abandoned" in call.thread.name  # nothing joins it at exit
    assert "agent tests:stuck (task t1," in stuck_report()
    release.set()  # it returns at last: its thread ends, and it is no longer listed
    call.thread.join(5)
    assert not call.thread.is_alive() and pool.in_user_code() == [] and pool.abandoned_now == 0
    pool.close()


def test_too_many_stuck_threads_refuse_further_calls():
    release = threading.Event()

    async def main(pool: UserThreads) -> None:
        for _ in range(2):
            with pytest.raises(TimeoutError):
                await pool.call(release.wait, what="reward function tests:stuck", timeout_s=0.5)
        with pytest.raises(RuntimeError, match="2 threads are stuck in user code"):
            await pool.call(lambda: 1, what="reward function tests:quick", timeout_s=5)

    pool = UserThreads(1, max_abandoned=2)
    try:
        asyncio.run(main(pool))
    finally:
        release.set()
        pool.close()


def train_process(out: Path, marker: Path, config: str, *overrides: str, **popen: object) -> subprocess.Popen:
    """``asyncrl train CONFIG`` in a child process with this folder's modules importable;
    user code here announces itself by creating ``marker``."""
    env = {**os.environ, "PYTHONPATH": TESTS, "ASYNCRL_TEST_MARKER": str(marker), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "train", config, f"output_dir={out}", *overrides],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, **popen)


@contextlib.contextmanager
def _train(tmp_path: Path, name: str, *overrides: str) -> Iterator[tuple[subprocess.Popen, Path, Path]]:
    """``asyncrl train`` of the agent example in a child process, on the test policy; the
    child is killed on the way out if it still runs (a failed test included)."""
    out, marker = tmp_path / name, tmp_path / f"{name}.called"
    proc = train_process(out, marker, "examples/openai_agent/train.yaml", "total_steps=2", "batch_size=2",
                         "group_size=2", "eval.num_tasks=1", "eval.samples_per_task=1", "task.num_train=16",
                         "task.num_validation=4", "rollout.max_concurrent_episodes=4", "workflow.timeout_s=1",
                         "workflow.max_retries=0", *overrides)
    try:
        yield proc, out, marker
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _wait_for(marker: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the user code was never called"


@pytest.mark.parametrize("stuck, sig", [("agent", signal.SIGTERM), ("reward", signal.SIGINT)])
@pytest.mark.slow
def test_a_signal_ends_a_run_stuck_in_user_code_with_its_checkpoint(tmp_path, policy_dir, stuck, sig):
    user = (["workflow.agent=test_stoppable:hang_forever"] if stuck == "agent" else
            ["workflow.name=single_turn", "task.reward_fn=test_stoppable:hang_reward"])
    with _train(tmp_path, stuck, f"model.path={policy_dir}", "watchdog.max_error_rate=1", *user) as (proc, out, marker):
        _wait_for(marker, proc)
        time.sleep(1.5)  # past workflow.timeout_s: some calls are abandoned, new ones stuck again
        sent = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    text = err.decode()
    assert proc.returncode == 0, text[-3000:]
    # seconds with nothing else running; generous for a loaded 2-core machine, and far under the
    # hour the stuck code sleeps
    assert took < 30, f"{took:.1f} s from the signal to the exit"
    what = "agent test_stoppable:hang_forever" if stuck == "agent" else "reward function test_stoppable:hang_reward"
    assert "still in user code, not waited for: " + what in text, text[-3000:]
    assert "interrupted at step 0" in text
    assert (out / "checkpoints" / "step_0" / "model.safetensors").exists()  # the clean stop's checkpoint


@pytest.mark.slow
def test_the_watchdog_stops_a_run_whose_every_agent_call_hangs(tmp_path, policy_dir):
    with _train(tmp_path, "watchdog", f"model.path={policy_dir}", "watchdog.window=8",
                "workflow.agent=test_stoppable:hang_forever") as (proc, _, _):
        _, err = proc.communicate(timeout=120)
    text = err.decode()
    assert proc.returncode == 1, text[-3000:]
    assert "stopped by the watchdog: 8 of the last 8 episodes failed" in text
    assert "abandoned on their threads" in text
    assert "still in user code, not waited for: agent test_stoppable:hang_forever" in text


def hang_loss(*args, **kwargs):
    """A user's policy loss that announces itself, then never returns (on the learner's thread)."""
    _announce()
    time.sleep(HANG_S)


@pytest.mark.parametrize("own_process,stuck", [
    (False, "still in user code, not waited for: learner train_step"),
    (True, "the learner's train_step had not returned after"),
])
@pytest.mark.slow
def test_a_second_signal_ends_a_run_whose_loss_never_returns(tmp_path, policy_dir, own_process, stuck):
    """The learner's thread is a daemon of its own pool too (or the learner is a process of
    its own): a first signal waits for the step (it cannot finish), a second ends the run,
    naming what was stuck."""
    with _train(tmp_path, "loss", f"model.path={policy_dir}", "workflow.name=single_turn",
                "algorithm.filter_zero_variance=false", "algorithm.policy_loss=test_stoppable:hang_loss",
                f"learner.process={str(own_process).lower()}") as (proc, _, marker):
        _wait_for(marker, proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # the step cannot finish
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    text = err.decode()
    assert proc.returncode == 1, text[-3000:]
    assert took < 30, f"{took:.1f} s from the second signal to the exit"  # as above: generous, far under an hour
    assert "stopped by a second signal" in text
    assert stuck in text, text[-3000:]
