"""One learner in a process of its own (``learner.process``): where it runs by default,
the published weights crossing through shared memory exact and owned by the driver, and
a run whose learner sits in its own process taking the steps the in-process one takes."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.runtime import learner_processes
from asyncrl.runtime.rank_processes import RankProcesses
from asyncrl.runtime.shared_weights import ALIGN, Layout, WeightBlock, WeightReader
from asyncrl.runtime.transport import LearnerGroup
from own_resources import is_anonymous, shm_held
from test_sharded_learner import assert_same_metrics, assert_same_weights, batch, config, one_rank


@pytest.mark.parametrize("overrides,expected", [
    (["mode=async"], 1), (["mode=one_step_off"], 1), (["mode=sync"], 0),
    (["mode=async", "learner.process=false"], 0), (["mode=sync", "learner.process=true"], 1),
    (["mode=sync", "learner.world_size=2"], 2), (["mode=async", "learner.world_size=3", "learner.process=false"], 3),
])
def test_the_learner_has_its_own_process_on_the_cpu_beside_a_generating_engine(overrides, expected):
    assert learner_processes(load_config(None, ["model.device=cpu", *overrides])) == expected


def weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "c.steps": torch.randint(0, 100, (2, 2), generator=g), "d.scale": torch.randn((), generator=g)}


def test_shared_weights_cross_exactly_and_the_driver_owns_its_copy():
    layout = Layout.of(weights(0))
    assert all(offset % ALIGN == 0 for offset in layout.offsets) and layout.nbytes >= 15 * 4 + 7 * 2 + 4 * 8 + 4
    held_before = shm_held([os.getpid()])  # this process's own names: other programs' come and go
    block, reader = WeightBlock(), WeightReader()

    def received(snapshot):  # the descriptor as the driver receives it: its own copy of it
        if snapshot.new:
            reader.attach(snapshot, os.dup(block.descriptor()))
        return reader.read(snapshot)

    try:
        snapshot = block.write(weights(0))
        assert snapshot.new
        first = received(snapshot)
        for name, tensor in weights(0).items():
            assert first[name].dtype == tensor.dtype and torch.equal(first[name], tensor), name
        snapshot = block.write(weights(1))  # the block is rewritten: what was read before stays as it was
        assert not snapshot.new
        assert torch.equal(first["a.weight"], weights(0)["a.weight"])
        assert torch.equal(received(snapshot)["a.weight"], weights(1)["a.weight"])
        grown = {**weights(2), "e.new": torch.ones(4)}  # another layout: another block
        moved = block.write(grown)
        assert moved.new and moved.block != snapshot.block
        with pytest.raises(RuntimeError, match="descriptor never arrived"):  # the old mapping is not read again
            reader.read(moved)
        assert_same_weights(received(moved), grown)
        assert is_anonymous(block.descriptor())  # anonymous: no name any kill could leave behind
        assert shm_held([os.getpid()]) == held_before  # and neither side opened a named one
    finally:
        reader.close()
        block.close()


def test_one_rank_in_its_own_process_takes_the_in_process_step_and_publishes_it_whole(policy_dir):
    cfg = config(policy_dir, "optim.micro_batch_size=64", "learner.process=true")
    _, expected_weights, (expected_metrics,) = one_rank(cfg, batch(0))

    async def scenario():
        learner = LearnerGroup(RankProcesses(cfg, world_size=1))
        try:
            await learner.transport.start()
            metrics = await learner.train_step(batch(0), False)
            published = await learner.publish()
            # what the driver and the rank hold while both live: their own names, not the machine's
            held = shm_held([os.getpid(), *(p.pid for p in learner.transport.procs)])
            return metrics, published, learner.transport._weights._id, held
        finally:
            await learner.shutdown()

    held_before = shm_held([os.getpid()])
    metrics, published, block, held = asyncio.run(scenario())
    assert_same_metrics(metrics, expected_metrics)
    assert_same_weights(published, expected_weights)
    assert block == 1  # the weights came through the rank's one shared block, not the pipe
    assert held <= held_before  # and it was anonymous: neither side held a name a kill could leave behind


def test_an_async_run_with_its_learner_in_a_process_trains_within_the_bound(tmp_path, policy_dir):
    out = tmp_path / "run"
    overrides = [f"model.path={policy_dir}", f"output_dir={out}", "mode=async", "max_staleness=1", "total_steps=3",
                 "batch_size=2", "group_size=2", "eval_every=0", "eval.num_tasks=2", "eval.samples_per_task=1",
                 "task.num_train=32", "task.num_validation=4", "algorithm.filter_zero_variance=false",
                 "optim.micro_batch_size=4", "model.device=cpu"]
    assert learner_processes(load_config("examples/countdown/async.yaml", overrides)) == 1  # the default's choice
    assert main(["train", "examples/countdown/async.yaml", *overrides]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [0, 1, 2, 3]
    assert all(m["staleness/max"] <= 1 for m in metrics[1:])
    assert all(m["time/weight_sync"] > 0 for m in metrics[1:])
    assert (out / "checkpoints" / "step_3" / "model.safetensors").exists()
