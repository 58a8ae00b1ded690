"""Errors are never swallowed: whatever runs beside the train loop (a completion callback,
a task of the run's task group, the rollout loop's groups, the watchdog, the learner's
wait for data) fails the run with exit 1 naming what failed, as the same failure on the
train loop's own call does, and the rows written before it stay, in order, once each.

The row of a step whose evaluation ran in the background is written in the evaluation's
completion callback; an exception there went to the event loop's handler, was printed
and lost, and the run exited 0 (issue 33)."""

from __future__ import annotations

import asyncio
import inspect
import json

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.orchestrator import evaluations, rollout_loop
from asyncrl.orchestrator.buffer import GroupBuffer
from asyncrl.orchestrator.runlog import LogWriteError, RunLog
from asyncrl.orchestrator.watchdog import Watchdog


class InjectedFailure(Exception):
    """Raised where a test breaks the run on purpose."""


def test_a_row_whose_write_fails_in_the_evaluation_callback_fails_the_log(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}"])
    broken = {2}

    async def main_() -> None:
        log = RunLog(cfg, tmp_path)
        write = log._write_metrics

        def failing_write(row):
            if row["step"] in broken:
                raise InjectedFailure("disk full")
            write(row)

        log._write_metrics = failing_write
        try:
            watcher = asyncio.ensure_future(log.failed())
            log.step({"step": 1})
            evaluation = asyncio.get_running_loop().create_future()
            log.step({"step": 2}, evaluation)  # queued until its evaluation ends
            log.step({"step": 3})  # behind it
            await asyncio.sleep(0)
            assert not watcher.done()
            evaluation.set_result({"eval/reward_mean": 0.5})  # the row is written in the callback, and fails
            with pytest.raises(LogWriteError) as info:
                await asyncio.wait_for(watcher, 5)
            assert str(info.value) == ("writing the metrics row of step 2 (once its evaluation had finished) failed: "
                                       "InjectedFailure: disk full")
            assert isinstance(info.value.__cause__, InjectedFailure)
            with pytest.raises(LogWriteError):  # the train loop's next call fails too
                log.step({"step": 4})
            with pytest.raises(LogWriteError):
                await log.flushed()
        finally:
            log.close()

    asyncio.run(main_())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]  # nothing written after the failure, nothing twice


TRAIN = ["train", "examples/countdown/async.yaml", "mode=async", "max_staleness=2", "total_steps=200",
         "batch_size=2", "group_size=2", "eval_every=2", "eval.num_tasks=2", "eval.samples_per_task=1",
         "task.num_train=64", "task.num_validation=4", "algorithm.filter_zero_variance=false",
         "task.reward_fn=test_reproducible:parity", "learner.process=false"]


def failing_from(calls: int, original):
    """``original`` (plain or ``async``), raising :class:`InjectedFailure` from its
    ``calls``-th call on."""
    count = 0

    def count_or_fail() -> None:
        nonlocal count
        count += 1
        if count >= calls:
            raise InjectedFailure(f"{original.__qualname__}, call {count}")

    if inspect.iscoroutinefunction(original):
        async def wrapped(*args, **kwargs):
            count_or_fail()
            return await original(*args, **kwargs)
    else:
        def wrapped(*args, **kwargs):
            count_or_fail()
            return original(*args, **kwargs)
    return wrapped


def call_fails(owner, name: str, calls: int):
    """``owner.name`` fails from its ``calls``-th call on."""
    def inject(monkeypatch):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, failing_from(calls, original))
        return f"InjectedFailure: {original.__qualname__}, call {calls}"

    return inject


def row_write_fails(step: int, when: str):
    """The metrics row of ``step`` cannot be written."""
    def inject(monkeypatch):
        original = RunLog._write_metrics

        def write(self, row):
            if row["step"] == step:
                raise InjectedFailure(f"the row of step {step}")
            original(self, row)

        monkeypatch.setattr(RunLog, "_write_metrics", write)
        return f"writing the metrics row of step {step} ({when}) failed: InjectedFailure"

    return inject


FAILURES = {
    # step 2 has an evaluation, beside training: its row is written in the evaluation's completion callback
    "the row written after an evaluation": row_write_fails(2, "once its evaluation had finished"),
    # step 3 has none: its row is written on the train loop's own call
    "the row written by a step": row_write_fails(3, "at the end of the step"),
    "an evaluation beside training (a task of the run's group)": call_fails(evaluations, "eval_metrics", 2),
    "a group of the rollout loop (a task of its own group)": call_fails(rollout_loop, "compute_advantages", 6),
    "the watchdog (a side task of the run)": call_fails(Watchdog, "watch", 1),
    "the learner's wait for data (a future raced against a stop)": call_fails(GroupBuffer, "take", 4),
}


@pytest.mark.parametrize("where", list(FAILURES))
def test_a_failure_beside_the_train_loop_fails_the_run_naming_it(where, tmp_path, policy_dir, monkeypatch, capsys):
    said = FAILURES[where](monkeypatch)
    out = tmp_path / "run"
    assert main([*TRAIN, f"model.path={policy_dir}", f"output_dir={out}"]) == 1
    err = capsys.readouterr().err
    assert said in err, err[-3000:]
    assert "asyncrl train: failed (see the traceback above)" in err
    metrics = out / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
    assert steps == sorted(set(steps)), "rows in step order, each once"
    assert not steps or steps[-1] < 200, "the run stopped at the failure, not at its end"
