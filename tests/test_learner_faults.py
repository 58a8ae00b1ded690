"""The learner's own process under every fault (docs/faults.md): a hung call is named and
ends the run at its deadline, a first signal ends a hung call within its grace, nothing
of a run outlives its driver however it dies, no shared memory is left in ``/dev/shm``,
and a dead fork server, a dead rank or a lost block is said as what it is. Real processes
and real signals: what is tested is how they end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.runtime.fork_server import fork_server
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.runtime.rank_processes import RankProcesses
from asyncrl.runtime.transport import CallDeadlines, LearnerGroup, LearnerRankError
from own_resources import alive, descendants, shm_held, shm_left
from test_sharded_learner import config
from test_stoppable import train_process

# ------------------------------------------------------------------ the deadline rule
def test_a_calls_deadline_is_its_floor_or_a_multiple_of_the_slowest_and_a_stop_shortens_it():
    d = CallDeadlines(floor_s=5, factor=10, stop_grace_s=3)
    assert d.deadline("train_step", 100.0) == 105.0  # nothing measured yet: the floor
    d.took("train_step", 0.2)
    d.took("train_step", 1.5)
    d.took("train_step", 0.4)  # the slowest is kept
    assert d.deadline("train_step", 100.0) == 115.0  # 10 × 1.5 s beats the 5 s floor
    assert d.deadline("publish", 100.0) == 105.0  # each kind of call on its own record
    d.stop_asked_at = 102.0  # a stop, 2 s into a call: max(3, 2 × 1.5) s from then
    assert d.deadline("train_step", 100.0) == 105.0
    assert d.deadline("publish", 101.0) == 105.0  # min(floor 106, stop 102 + 3)
    assert d.deadline("save_checkpoint", 103.0) == 108.0  # made after the stop: its own deadline
    assert "watchdog.learner_call_s=5" in d.rule("train_step") and "1.5 s" in d.rule("train_step")


# ------------------------------------------------------------------ runs in a child process
def rank_of(pids: set[int]) -> int:
    """The learner's rank process among ``pids`` (named ``asyncrl-rank0``)."""
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == "asyncrl-rank0":
                return pid
    raise AssertionError(f"no learner rank among {sorted(pids)}")


@contextlib.contextmanager
def training(tmp_path: Path, *overrides: str, name: str = "run") -> Iterator[tuple[subprocess.Popen, Path, Path]]:
    """``asyncrl train`` of Countdown on the test policy with the learner in its own process,
    in a session of its own; every process of it is killed on the way out."""
    out, marker = tmp_path / name, tmp_path / f"{name}.called"
    proc = train_process(out, marker, "examples/countdown/async.yaml", "learner.process=true", "total_steps=400",
                         "batch_size=2", "group_size=2", "eval_every=0", "eval.num_tasks=2", "eval.samples_per_task=1",
                         "task.num_train=64", "task.num_validation=4", "algorithm.filter_zero_variance=false",
                         *overrides, start_new_session=True)
    try:
        yield proc, out, marker
    finally:
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def wait_until(condition, proc: subprocess.Popen, what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stderr.read().decode()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.1)


def steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if json.loads(line).get("step", 0) > 0) \
        if path.exists() else 0


def ended(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, float]:
    start = time.monotonic()
    _, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, err.decode(), time.monotonic() - start


@pytest.mark.slow
def test_a_stopped_learner_process_ends_the_run_at_its_deadline_naming_the_call(tmp_path, policy_dir):
    with training(tmp_path, f"model.path={policy_dir}", "watchdog.learner_call_s=5") as (proc, out, _):
        wait_until(lambda: steps_logged(out) >= 3, proc, "three steps")  # the calls' times are measured
        ranks = descendants(proc.pid)
        os.kill(rank_of(ranks), signal.SIGSTOP)
        code, err, took = ended(proc, timeout_s=120)
    print(f"stopped learner: exit {code} {took:.1f} s after the SIGSTOP")
    assert code == 1, err[-3000:]
    assert re.search(r"the learner's \w+ had not returned after \d+ s, past its deadline "
                     r"\(watchdog.learner_call_s=5", err), err[-3000:]
    assert "stopped (SIGSTOP)" in err and "0.0 s of CPU since the call began" in err and "its process killed" in err
    assert "asyncrl train: the run failed; last good checkpoint:" in err
    assert took < 60, f"{took:.0f} s from the stop to the exit (deadline 5 s)"
    time.sleep(1)
    assert alive(ranks) == set()  # the stopped rank was killed, the fork server went with the driver


@pytest.mark.parametrize("own_process", [True, False])
@pytest.mark.slow
def test_a_loss_that_never_returns_is_named_at_its_deadline(tmp_path, policy_dir, own_process):
    with training(tmp_path, f"model.path={policy_dir}", "watchdog.learner_call_s=4",
                  "algorithm.policy_loss=test_stoppable:hang_loss",
                  f"learner.process={str(own_process).lower()}") as (proc, _, marker):
        wait_until(marker.exists, proc, "the loss called")
        code, err, took = ended(proc, timeout_s=120)
    print(f"hung loss (own process {own_process}): exit {code} {took:.1f} s after the loss was called")
    assert code == 1, err[-3000:]
    assert "the learner's train_step had not returned after" in err, err[-3000:]
    if own_process:
        assert "sleeping" in err and "its process killed" in err
    else:  # the thread's stack says where it hangs
        assert re.search(r"test_stoppable.py:\d+ in hang_loss", err), err[-3000:]
        assert "a thread cannot be ended" in err
    assert took < 60, f"{took:.0f} s from the hang to the exit (deadline 4 s)"


@pytest.mark.slow
def test_a_first_signal_ends_a_hung_learner_call_within_its_grace(tmp_path, policy_dir):
    with training(tmp_path, f"model.path={policy_dir}", "watchdog.learner_stop_grace_s=3",
                  "algorithm.policy_loss=test_stoppable:hang_loss") as (proc, _, marker):
        wait_until(marker.exists, proc, "the loss called")
        proc.send_signal(signal.SIGTERM)
        code, err, took = ended(proc, timeout_s=120)
    print(f"first signal, hung loss: exit {code} {took:.1f} s after the SIGTERM")
    assert code == 1, err[-3000:]
    assert "a stop was asked, so at most watchdog.learner_stop_grace_s=3 s after it" in err, err[-3000:]
    assert "its process killed" in err
    assert took < 30, f"{took:.0f} s from the signal to the exit (grace 3 s; the call's floor is 300 s)"


@pytest.mark.parametrize("kill", ["driver, learner hung in user code", "driver, learner stopped",
                                  "the whole process group"])
@pytest.mark.slow
def test_nothing_of_a_run_outlives_its_driver(tmp_path, policy_dir, kill):
    hang = ["algorithm.policy_loss=test_stoppable:hang_loss"] if "hung" in kill else []
    with training(tmp_path, f"model.path={policy_dir}", *hang) as (proc, out, marker):
        wait_until(marker.exists if hang else lambda: steps_logged(out) >= 2, proc, "the learner at work")
        run = descendants(proc.pid)
        assert len(run) >= 2, run  # the fork server and the learner at least
        held = shm_held({proc.pid, *run})  # the run's own names, not the machine's: others come and go
        if "stopped" in kill:
            os.kill(rank_of(run), signal.SIGSTOP)
        if kill == "the whole process group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while alive(run) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = alive(run)
        print(f"{kill}: {len(run)} processes of the run, {len(left)} left "
              f"{time.monotonic() - deadline + 10:.1f} s after the driver's exit")
        err = proc.stderr.read().decode() if not left else ""
    assert left == set(), f"alive 10 s after the driver was killed: {sorted(left)}"
    # no name the run held is left in /dev/shm, whatever the kill (the weights' block has no name)
    assert shm_left(held) == set(), f"the run held {sorted(held)}"
    # the survivors went quietly: no traceback of a lost driver, no tracker's warnings
    assert "Traceback" not in err and "leaked" not in err and "ConnectionResetError" not in err, err[-3000:]


@pytest.mark.slow
def test_a_killed_fork_server_is_said_as_that(tmp_path, policy_dir):
    with training(tmp_path, f"model.path={policy_dir}") as (proc, out, _):
        wait_until(lambda: steps_logged(out) >= 2, proc, "two steps")
        with open(f"/proc/{rank_of(descendants(proc.pid))}/stat") as f:
            server = int(f.read().rsplit(")", 1)[1].split()[1])  # the rank's parent
        assert server != proc.pid
        os.kill(server, signal.SIGKILL)
        code, err, _ = ended(proc, timeout_s=120)
    assert code == 1, err[-3000:]
    assert "learner rank 0 of 1 failed:\nthe learner's fork server died, and its process with it" in err, err[-3000:]
    assert "exit code 255" not in err


# ------------------------------------------------------------------ the transport, in this process
class NoBlockRank(LearnerWorker):
    """A rank whose process may not make a file of more than a page: its shared-memory block
    for the weights cannot be made (as when /dev/shm or RAM is short)."""

    def join(self, init_method=None, local_rank=0):
        super().join(init_method, local_rank)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_weights_cross_the_pipe_when_no_block_can_be_made_and_it_is_said_once(policy_dir, capfd):
    cfg = config(policy_dir, "learner.process=true")

    async def scenario():
        learner = LearnerGroup(RankProcesses(cfg, world_size=1, worker_cls=NoBlockRank))
        try:
            await learner.transport.start()
            return await learner.publish(), await learner.publish()
        finally:
            await learner.shutdown()

    # the rank writes to the fork server's standard error, which is this process's as it was
    # when the server started: start one now, under capfd, and end it after
    fork_server().stop()
    try:
        first, second = asyncio.run(scenario())
    finally:
        fork_server().stop()
    expected = LearnerWorker(cfg)
    expected.join()
    for name, tensor in expected.publish().items():
        assert torch.equal(first[name], tensor) and torch.equal(second[name], tensor), name
    said = [line for line in capfd.readouterr().err.splitlines() if "cross the pipe" in line]
    assert len(said) == 1, said
    assert re.fullmatch(r"asyncrl: learner rank 0: a shared-memory block of [\d.]+ MiB for the weights could not be "
                        r"reserved: File too large; the weights cross the pipe instead \(slower\)", said[0]), said


def test_a_rank_killed_by_a_bus_error_is_said_as_that(policy_dir):
    cfg = config(policy_dir, "learner.process=true")

    async def scenario():
        learner = LearnerGroup(RankProcesses(cfg, world_size=1))
        try:
            await learner.transport.start()
            os.kill(learner.transport.procs[0].pid, signal.SIGBUS)
            learner.transport.procs[0].join(timeout=10)
            with pytest.raises(LearnerRankError) as failure:
                await learner.publish()
            return str(failure.value)
        finally:
            await learner.shutdown()

    error = asyncio.run(scenario())
    assert "learner rank 0 of 1 failed:\nits process died of a bus error (SIGBUS)" in error, error
    assert "shared memory (/dev/shm) or RAM running out" in error


def test_a_rank_error_crosses_a_process_boundary_with_its_traceback():
    """`asyncrl bench` runs each system in a process pool: the error must unpickle whole,
    or the pool reports a broken process and the rank's traceback is lost."""
    import pickle

    err = LearnerRankError(1, 2, "Traceback ...\nValueError: boom")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is LearnerRankError
    assert str(back) == "learner rank 1 of 2 failed:\nTraceback ...\nValueError: boom"
    assert (back.rank, back.world_size, back.detail) == (1, 2, "Traceback ...\nValueError: boom")
