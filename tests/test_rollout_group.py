"""Several rollout workers behind the one rollout handle (``RolloutGroup``): groups spread
over the workers by load, evaluations sharded and merged, weights to every one, counts
summed; and a whole local run with two workers trained within η."""

from __future__ import annotations

import asyncio
import json

import torch

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.runtime.rollout_group import InProcessRollouts, RolloutGroup
from asyncrl.rollout.worker import RolloutWorker, _TimedEngine
from asyncrl.tasks.countdown import iter_countdown
from asyncrl.types import Completion, SamplingParams


def test_groups_spread_over_two_workers_and_an_evaluation_is_sharded_and_merged(policy_dir):
    cfg = load_config("examples/countdown/async.yaml", [f"model.path={policy_dir}", "sampling.max_tokens=8",
                                                         "eval.samples_per_task=2"])
    tasks = [task for task, _ in zip(iter_countdown(seed=5), range(6))]

    async def scenario():
        transport = InProcessRollouts([RolloutWorker(cfg, seed=i, num_threads=1) for i in range(2)])
        group = RolloutGroup(transport)
        try:
            await transport.start()
            groups = await asyncio.gather(*[group.run_group(task, 3) for task in tasks[:4]])
            tokens = [w.engine.stats.tokens for w in transport.workers]
            seen = []
            result = await group.evaluate(tasks, version=0, on_episode=seen.append)
            weights = {k: v.detach() + 0.01 for k, v in transport.workers[0].engine.model.named_parameters()}
            served = await group.sync_weights(weights, 1, "abort")
            work = await group.engine_work()
            return groups, tokens, seen, result, served, work, [w.engine.stats.tokens for w in transport.workers]
        finally:
            await group.shutdown()

    groups, tokens, seen, result, served, work, tokens_after = asyncio.run(scenario())
    assert [len(g) for g in groups] == [3] * 4
    assert [g[0].task_id for g in groups] == [t.id for t in tasks[:4]]
    assert all(t > 0 for t in tokens), tokens  # both workers generated: groups went to the less loaded
    assert result.num_tasks == 6 and len(seen) == 12  # every task's samples, from the two shards, each seen once
    assert sorted(e.task_id for e in seen) == sorted(t.id for t in tasks for _ in range(2))
    assert served == [1, 1]  # each worker serves the new version
    assert work["tokens"] == sum(tokens_after)  # counts summed over the workers
    assert torch.isfinite(torch.tensor(work["busy_s"]))


def test_a_local_run_with_two_rollout_workers_trains_within_the_bound(tmp_path, policy_dir):
    out = tmp_path / "run"
    assert main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "rollout.num_workers=2", "mode=async", "max_staleness=1", "total_steps=3", "batch_size=2",
                 "group_size=2", "eval_every=3", "eval.num_tasks=4", "eval.samples_per_task=1", "task.num_train=32",
                 "task.num_validation=4", "algorithm.filter_zero_variance=false"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert "eval/reward_mean" in metrics[0] and "eval/reward_mean" in metrics[-1]
    assert len(samples) == 3 * 2 * 2
    assert max(s["trained_version"] - s["behavior_version_min"] for s in samples) <= 1


class _Engine:
    """Three tokens, sampled one after another; ``streams``: handed out as sampled."""
    max_context = 1 << 30  # the engine contract's context: no bound that matters here

    def __init__(self, streams: bool) -> None:
        if streams:
            self.generate = self._streaming

    async def generate(self, prompt_ids, sampling):
        return Completion([7, 8, 9], [-0.1, -0.2, -0.3], [0, 0, 0], "stop")

    async def _streaming(self, prompt_ids, sampling, on_tokens=None):
        for token in (7, 8, 9):
            await asyncio.sleep(0)
            if on_tokens is not None:
                on_tokens([token])
        return Completion([7, 8, 9], [-0.1, -0.2, -0.3], [0, 0, 0], "stop")


def test_an_episodes_engine_streams_when_its_engine_does_and_hands_all_at_once_when_not():
    async def chunks(streams: bool) -> list[list[int]]:
        seen: list[list[int]] = []
        timed = _TimedEngine(_Engine(streams))
        completion = await timed.generate([1, 2], SamplingParams(), on_tokens=seen.append)
        assert completion.token_ids == [7, 8, 9] and timed.engine_s > 0
        return seen

    assert asyncio.run(chunks(True)) == [[7], [8], [9]]  # a streamed reply in a training session
    assert asyncio.run(chunks(False)) == [[7, 8, 9]]  # every token before the completion, as promised
