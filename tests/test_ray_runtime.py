"""``runtime: ray`` on CPU: two rollout workers and the learner as actors of a local Ray
cluster; a worker killed mid-run is replaced and the run completes."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.orchestrator.trainer import Trainer

ray = pytest.importorskip("ray")

RAY = ["runtime=ray", "ray.num_cpus=2", "ray.num_rollout_workers=2", "ray.worker_cpus=0.5", "ray.learner_cpus=1"]


def overrides(policy_dir, out, *extra):
    return [f"model.path={policy_dir}", f"output_dir={out}", "mode=async", "max_staleness=2", "partial_rollout=abort",
            "total_steps=6", "batch_size=2", "group_size=4", "eval.num_tasks=4", "eval.samples_per_task=2",
            "eval_every=3", "save_every=3", "task.num_train=64", "task.num_validation=8",
            "algorithm.filter_zero_variance=false", *extra]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_killed_rollout_worker_is_replaced_and_the_run_completes(tmp_path, policy_dir):
    out = tmp_path / "ray"
    trainer = Trainer(load_config("examples/countdown/async.yaml", overrides(policy_dir, out, *RAY)))
    killed = []

    async def kill_a_worker_after_step_2():
        while not any(r["step"] >= 2 for r in read_jsonl(out / "metrics.jsonl")):
            await asyncio.sleep(0.05)
        pid = (await trainer.rollout.apply(lambda worker, index: os.getpid()))[0]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    async def scenario():
        killer = asyncio.create_task(kill_a_worker_after_step_2())
        try:
            return await trainer.run_async()
        finally:
            if killer.done():
                killer.result()  # a failure to kill is the test's failure, not swallowed
            killer.cancel()

    checkpoint = asyncio.run(scenario())
    assert killed, "the run ended before a worker could be killed"
    assert not ray.is_initialized()  # the run started Ray and shut it down
    metrics = read_jsonl(out / "metrics.jsonl")
    samples = read_jsonl(out / "samples.jsonl")
    assert [m["step"] for m in metrics] == list(range(7))
    assert [m["version"] for m in metrics] == list(range(7))
    assert metrics[-1]["rollout/worker_restarts_total"] >= 1
    assert len(samples) == 6 * 2 * 4
    assert len({(s["group"], s["episode"]) for s in samples}) == len(samples)  # a re-issued group trained once
    assert max(s["trained_version"] - s["behavior_version_min"] for s in samples) <= 2
    assert "eval/reward_mean" in metrics[3] and "eval/reward_mean" in metrics[6]
    assert checkpoint.name == "step_6" and (checkpoint / "model.safetensors").exists()

    # resume on Ray: the learner actor loads the checkpoint, workers start from its weights
    assert main(["train", "examples/countdown/async.yaml", *overrides(policy_dir, out, *RAY, "total_steps=8",
                                                                      "resume=true")]) == 0
    resumed = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in resumed] == list(range(9)) and [m["version"] for m in resumed] == list(range(9))
    assert resumed[:7] == metrics
    after = read_jsonl(out / "samples.jsonl")
    assert len({(s["group"], s["episode"]) for s in after}) == len(after) == 8 * 2 * 4
    assert min(s["behavior_version_min"] for s in after if s["step"] > 6) >= 6 - 2

    # runtime=local writes the same outputs (the keys scripts read)
    local = tmp_path / "local"
    assert main(["train", "examples/countdown/async.yaml", *overrides(policy_dir, local, "total_steps=3")]) == 0
    local_metrics = read_jsonl(local / "metrics.jsonl")
    assert set(local_metrics[1]) == set(metrics[1])
    assert set(read_jsonl(local / "samples.jsonl")[0]) == set(samples[0])


def test_more_workers_than_the_cluster_has_exits_2(tmp_path, policy_dir, capsys):
    code = main(["train", "examples/countdown/async.yaml",
                 *overrides(policy_dir, tmp_path / "too_many", *RAY, "ray.num_rollout_workers=8", "ray.worker_cpus=1")])
    assert code == 2
    assert "ray.num_rollout_workers=8" in capsys.readouterr().err
    assert not ray.is_initialized()
