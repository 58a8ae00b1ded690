"""The orchestrator's top floor: the watchdog stops runs that cannot make progress,
episodes in flight stay under their bound, evaluation runs beside training, hooks are
called at the right moments, and a run embeds in any thread."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from asyncrl.cli import main
from asyncrl.config import WatchdogConfig, load_config
from asyncrl.orchestrator.trainer import Trainer
from asyncrl.orchestrator.watchdog import Watchdog
from asyncrl.types import AttemptError, Episode, SamplingParams


def args(policy_dir, out, *extra):
    return ["examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}", "total_steps=4",
            "batch_size=2", "group_size=4", "eval.num_tasks=4", "eval.samples_per_task=1", "eval_every=0",
            "task.num_train=64", "task.num_validation=8", "algorithm.filter_zero_variance=false", *extra]


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------- the watchdog
def broken_reward(task, response: str) -> float:
    raise KeyError("reward service returned no 'score'")


def constant_reward(task, response: str) -> float:
    return 0.0


def test_a_reward_that_always_raises_stops_the_run_within_a_minute(tmp_path, policy_dir, capsys):
    """The shipped example's settings and the default watchdog, with a broken reward."""
    out = tmp_path / "broken"
    start = time.perf_counter()
    code = main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "task.reward_fn=test_orchestrator:broken_reward"])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 1 and elapsed < 60
    assert "stopped by the watchdog" in err and "of the last 64 episodes failed" in err
    assert "Traceback" in err and "reward service returned no 'score'" in err  # the cause, on the screen
    assert "groups with every episode failed" in err and "last good checkpoint: none yet" in err
    errors = rows(out / "errors.jsonl")
    assert errors and all("reward service returned no 'score'" in e["exception"] for e in errors)
    assert {"step", "phase", "task_id", "attempt", "traceback"} <= set(errors[0])
    per_step = {}
    for e in errors:
        per_step[(e["step"])] = per_step.get(e["step"], 0) + 1
    assert max(per_step.values()) <= 20  # logging.max_errors_per_step


@pytest.mark.slow
def test_groups_that_are_all_filtered_stall_and_are_named(tmp_path, policy_dir, capsys):
    code = main(["train", *args(policy_dir, tmp_path / "flat", "task.reward_fn=test_orchestrator:constant_reward",
                                "algorithm.filter_zero_variance=true", "watchdog.stall_s=3")])
    err = capsys.readouterr().err
    assert code == 1
    assert "every group was filtered because all its samples scored the same" in err
    assert "groups filtered (all rewards equal)" in err and " 0 groups accepted" in err


def failed(task_id: str) -> Episode:
    return Episode(task_id, status="error", errors=[AttemptError(1, "ValueError: x", "Traceback ...")])


def test_watchdog_rules_with_a_fake_clock():
    now = [0.0]
    dog = Watchdog(WatchdogConfig(stall_s=10, window=4, max_error_rate=0.5), clock=lambda: now[0])
    for i in range(3):
        dog.episode(failed(str(i)), "train")
    assert dog.verdict() is None  # 3 failed, but the window of 4 is not full yet
    for outcome in ("ok", "ok", "fail", "fail"):  # windows: FFFo 3 > 2 ... see below
        if outcome == "ok":
            dog.episode(Episode("ok"), "train")
        else:
            dog.episode(failed("x"), "train")
    # windows seen: [F F F ok] would stop; what stands now is [ok ok F F]: 2, not more than 0.5 * 4
    assert dog.verdict() is None
    dog.episode(failed("5"), "train")  # [ok F F F]: 3 > 2
    assert "3 of the last 4 episodes failed" in dog.verdict()

    dog = Watchdog(WatchdogConfig(stall_s=10, window=4, max_error_rate=1.0), clock=lambda: now[0])
    for i in range(8):
        dog.episode(failed(str(i)), "eval")
    assert dog.verdict() is None  # a rate of 1 never stops
    now[0] = 100.0
    assert dog.verdict() is None  # not waiting for data: training or evaluating does not stall
    dog.waiting(True)
    now[0] = 105.0
    assert dog.verdict() is None
    dog.group("accepted")
    now[0] = 114.0
    assert dog.verdict() is None  # 9 s since the last accepted group
    now[0] = 116.0
    assert "waited 11 s" in dog.verdict() and "no group was accepted" in dog.verdict()
    assert "eval episode of task 7, attempt 1" in dog.report("x")


def test_an_error_rate_at_the_limit_does_not_stop():
    dog = Watchdog(WatchdogConfig(window=2, max_error_rate=0.5))
    dog.episode(failed("a"), "train")
    dog.episode(Episode("b"), "train")
    assert dog.verdict() is None  # 1 of 2 is not more than 0.5 of 2


# ------------------------------------------------------- bounded concurrency
class SpyWorkflow:
    """Counts the episodes in flight at once; each one really generates."""

    in_flight = peak = total = 0

    async def run(self, task, llm):
        cls = SpyWorkflow
        cls.in_flight += 1
        cls.total += 1
        cls.peak = max(cls.peak, cls.in_flight)
        try:
            response = await llm.generate(task.prompt, sampling=SamplingParams(max_tokens=2))
            await asyncio.sleep(0.001)
            return Episode(task.id, trajectories=llm.trajectories, reward=float(len(response.text) % 2))
        finally:
            cls.in_flight -= 1


def test_evaluation_of_256_tasks_never_exceeds_the_episode_bound(tmp_path, policy_dir, capsys):
    SpyWorkflow.in_flight = SpyWorkflow.peak = SpyWorkflow.total = 0
    code = main(["eval", "examples/countdown/eval.yaml", f"model.path={policy_dir}", f"output_dir={tmp_path}",
                 "workflow.name=test_orchestrator:SpyWorkflow", "eval.num_tasks=256", "eval.samples_per_task=4",
                 "task.num_validation=256", "task.num_train=16", "rollout.max_concurrent_episodes=16"])
    assert code == 0, capsys.readouterr().err
    assert SpyWorkflow.total == 1024
    assert SpyWorkflow.peak == 16  # reached, never exceeded
    assert json.loads((tmp_path / "eval.json").read_text())["num_tasks"] == 256


def test_an_evaluation_beside_training_takes_at_most_half_the_episode_slots(policy_dir):
    """On the evaluation replica (beside training) it leaves training's episodes the other half."""
    from asyncrl.rollout.worker import RolloutWorker
    from asyncrl.tasks.countdown import iter_countdown

    SpyWorkflow.in_flight = SpyWorkflow.peak = SpyWorkflow.total = 0
    cfg = load_config("examples/countdown/async.yaml", [f"model.path={policy_dir}", "eval.samples_per_task=4",
                                                         "workflow.name=test_orchestrator:SpyWorkflow",
                                                         "rollout.max_concurrent_episodes=8"])
    tasks = [task for task, _ in zip(iter_countdown(seed=5), range(8))]

    async def scenario():
        worker = RolloutWorker(cfg, seed=0, num_threads=1, eval_replica=True)
        try:
            await worker.start()
            return await worker.evaluate(tasks, version=0)
        finally:
            await worker.shutdown()

    result = asyncio.run(scenario())
    assert len(result.episodes) == SpyWorkflow.total == 32
    assert SpyWorkflow.peak == 4  # half of 8: reached, never exceeded


# --------------------------------------------------- evaluation beside training
def overlaps(events, a, b):
    return any(x["start"] < y["end"] and y["start"] < x["end"] for x in events if x["kind"] == a
               for y in events if y["kind"] == b)


@pytest.mark.parametrize("mode, beside", [("async", True), ("sync", False)])
@pytest.mark.slow
def test_evaluation_runs_beside_training_except_in_sync(tmp_path, policy_dir, mode, beside):
    out = tmp_path / mode
    extra = ["partial_rollout=off"] if mode == "sync" else []
    assert main(["train", *args(policy_dir, out, f"mode={mode}", "eval_every=1", "total_steps=6", "eval.num_tasks=8",
                                "eval.samples_per_task=4", "rollout.max_concurrent_episodes=8", *extra)]) == 0
    metrics = rows(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(7))  # in order, each once, every eval merged in
    assert all(m["eval/version"] == m["step"] for m in metrics)  # version-pinned: step N scores version N
    events = rows(out / "timeline.jsonl")
    assert overlaps(events, "train", "eval") is beside


# ------------------------------------------------------------------- hooks
CALLS: list[tuple] = []


def on_policy_updated(event):
    CALLS.append(("policy", event.step, event.version, "actor/grad_norm" in event.metrics))


async def on_step_end(event):
    CALLS.append(("step", event.step, event.version, event.metrics["step"]))
    if event.step == 2:
        path = await event.run.save()
        scores = await event.run.evaluate()
        CALLS.append(("saved", path.name, scores["eval/version"]))


def on_epoch_end(event):
    CALLS.append(("epoch", event.epoch, event.step))


def raising_hook(event):
    if event.step == 2:
        raise RuntimeError("deployment gate refused version 2")


def test_hooks_are_called_with_the_right_version(tmp_path, policy_dir):
    CALLS.clear()
    out = tmp_path / "hooks"
    assert main(["train", *args(policy_dir, out, "mode=sync", "partial_rollout=off", "task.num_train=8",
                                "hooks.on_policy_updated=test_orchestrator:on_policy_updated",
                                "hooks.on_step_end=test_orchestrator:on_step_end",
                                "hooks.on_epoch_end=test_orchestrator:on_epoch_end")]) == 0
    policy = [c[1:] for c in CALLS if c[0] == "policy"]
    assert policy == [(s, s, True) for s in (1, 2, 3, 4)]  # after each sync, the version the engines serve
    assert [c[1:] for c in CALLS if c[0] == "step"] == [(s, s, s) for s in (1, 2, 3, 4)]
    assert [c for c in CALLS if c[0] == "saved"] == [("saved", "step_2", 2)]
    epochs = [c for c in CALLS if c[0] == "epoch"]
    assert [c[1] for c in epochs] == [0] and epochs[0][2] in (3, 4)  # 8 tasks, 2 groups a step
    order = [c[0] for c in CALLS]
    assert order.index("policy") < order.index("step")  # a step's sync comes before its end
    assert (out / "checkpoints" / "step_2" / "model.safetensors").exists()


def test_a_raising_hook_fails_the_run_with_its_traceback(tmp_path, policy_dir, capsys):
    out = tmp_path / "raising"
    code = main(["train", *args(policy_dir, out, "save_every=1", "hooks.on_step_end=test_orchestrator:raising_hook")])
    err = capsys.readouterr().err
    assert code == 1
    assert "hooks.on_step_end (test_orchestrator:raising_hook) raised at step 2" in err
    assert "deployment gate refused version 2" in err and "Traceback" in err
    assert f"last good checkpoint: {out / 'checkpoints' / 'step_1'}" in err


# ------------------------------------------------------------- embedding
def test_a_run_in_another_thread_is_stopped_by_a_method(tmp_path, policy_dir):
    out = tmp_path / "embedded"
    trainer = Trainer(load_config(args(policy_dir, out, "total_steps=100000")[0], args(policy_dir, out,
                                                                                       "total_steps=100000")[1:]))
    result: dict = {}

    def target():
        try:
            result["checkpoint"] = trainer.run()
        except BaseException as exc:  # surfaced below
            result["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.time() + 120
    while time.time() < deadline and trainer.step < 2 and thread.is_alive():
        time.sleep(0.05)
    trainer.stop()
    thread.join(timeout=120)
    assert not thread.is_alive() and "error" not in result, result
    assert trainer.interrupted
    checkpoint = result["checkpoint"]
    assert checkpoint.name == f"step_{trainer.step}" and (checkpoint / "model.safetensors").exists()
    assert [m["step"] for m in rows(out / "metrics.jsonl")] == list(range(trainer.step + 1))
