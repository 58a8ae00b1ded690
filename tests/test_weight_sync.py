"""``weight_sync.method: collective``: the learner broadcasts to the rollout engines over a
gloo group of their own. In-process first (learner and two rollout workers in this
process, each rank on its own thread: fast), then across processes on a local Ray cluster
(two worker actors and the learner actor), then a whole ``asyncrl train`` on Ray."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.learner import pack_batch
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.rollout.worker import RolloutWorker
from asyncrl.runtime.transport import InProcess, LearnerGroup
from asyncrl.weight_sync import (
    CollectiveSync,
    ObjectStoreSync,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    fingerprint,
    plan_buckets,
)
from asyncrl.weight_sync.endpoints import join_receiver, served_fingerprint
from asyncrl.tasks.countdown import iter_countdown
from asyncrl.types import Trajectory


def config(policy_dir, *extra):
    return load_config(None, [f"model.path={policy_dir}", "sampling.max_tokens=8", "weight_sync=collective",
                              "weight_sync.timeout_s=5", *extra])


def train_one_step(worker: LearnerWorker) -> None:
    """Move the learner's weights away from the engines' (one step on made-up tokens)."""
    traj = [Trajectory([5, 6, 7], [8 + i, 9], [1, 1], [-1.0, -1.0], [0, 0]) for i in range(2)]
    worker.train_step(pack_batch(traj, [1.0, -1.0], 0), on_policy=False)


class TwoWorkers:
    """The rollout handle over in-process workers, fanned out as ``RayRollout`` does;
    ``joining`` leaves the others out of the group (a worker that never joins)."""

    def __init__(self, workers: list[RolloutWorker], joining: list[int] | None = None) -> None:
        self.workers, self.joining = workers, joining if joining is not None else list(range(len(workers)))

    async def sync_weights(self, weights, version, mode):
        return [v for part in await asyncio.gather(*[w.sync_weights(weights, version, mode) for w in self.workers])
                for v in part]

    async def apply(self, fn, *args):
        chosen = self.joining if fn is join_receiver else range(len(self.workers))
        return [v for part in await asyncio.gather(*[self.workers[i].apply(fn, *args, index=i) for i in chosen])
                for v in part]

    async def fingerprints(self):
        return await self.apply(served_fingerprint)


def learner_here(cfg) -> LearnerWorker:
    worker = LearnerWorker(cfg)
    worker.join()
    return worker


async def in_process(policy_dir, scenario, *extra, joining=None):
    """Run ``scenario(cfg, learner_worker, sync, workers)`` with the group formed; every
    engine, receiver and the learner's store are released on the way out, failing or not."""
    cfg = config(policy_dir, *extra)
    learner_worker = learner_here(cfg)
    workers = [RolloutWorker(cfg, seed=i) for i in range(2)]
    sync = CollectiveSync(cfg.weight_sync, LearnerGroup(InProcess(learner_worker)), TwoWorkers(workers, joining),
                          receivers=2)
    try:
        for w in workers:
            await w.start()
        await sync.connect()
        return await scenario(cfg, learner_worker, sync, workers)
    finally:
        await sync.close()
        for w in workers:
            await w.shutdown()


def test_collective_sync_to_two_workers_loads_the_learners_weights(policy_dir):
    async def scenario(cfg, learner_worker, sync, workers):
        before = await sync.rollout.fingerprints()
        train_one_step(learner_worker)
        expected = fingerprint(learner_worker.learner.module.named_parameters())
        assert all(digest != expected for _, digest in before)
        await sync.sync(1, "abort")
        assert await sync.rollout.fingerprints() == [(1, expected)] * 2
        task = next(iter_countdown(seed=3))
        for w in workers:  # tokens sampled after the sync carry the new version
            episodes = await w.run_group(task, 2)
            assert {v for e in episodes for t in e.trajectories for v in t.versions} == {1}
        train_one_step(learner_worker)  # generation under way goes on through a sync ("continue")
        group = asyncio.ensure_future(workers[0].run_group(task, 4))
        await sync.sync(2, "continue")
        assert {v for e in await group for t in e.trajectories for v in t.versions} <= {1, 2}
        assert await sync.rollout.fingerprints() == [
            (2, fingerprint(learner_worker.learner.module.named_parameters()))] * 2

    asyncio.run(in_process(policy_dir, scenario, "weight_sync.bucket_mb=0.01"))


def test_a_version_that_does_not_advance_is_an_error(policy_dir):
    async def scenario(cfg, learner_worker, sync, workers):
        await sync.sync(1, "abort")
        with pytest.raises(WeightSyncError, match="version 1 does not advance past version 1"):
            await sync.sync(1, "abort")

        async def stuck(weights, version):  # an engine that takes the weights but keeps its version
            pass

        workers[1].engine.update_weights = stuck
        with pytest.raises(WeightSyncError, match="after the weight sync of version 2: rollout worker 1 serves "
                                                  "version 1"):
            await sync.sync(2, "abort")
        # object_store too
        with pytest.raises(WeightSyncError, match="of version 3: rollout worker 1 serves version 1"):
            await ObjectStoreSync(sync.learner, sync.rollout).sync(3, "abort")

    asyncio.run(in_process(policy_dir, scenario))


@pytest.mark.slow
def test_a_worker_that_never_joins_fails_within_the_timeout_naming_it(policy_dir):
    async def scenario(*_):
        raise AssertionError("the group formed without rollout worker 1")

    async def attempt() -> tuple[WeightSyncError, float]:
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as failed:
            await in_process(policy_dir, scenario, "weight_sync.timeout_s=2", joining=[0])
        return failed.value, time.monotonic() - start

    error, elapsed = asyncio.run(attempt())
    assert "rank 2 (rollout worker 1) did not join the weight-sync group within weight_sync.timeout_s=2 s" in str(error)
    # the 2 s timeout plus starting two engines, generous for a loaded machine, and far under the
    # 60 s default an unheeded weight_sync.timeout_s would wait
    assert elapsed < 2 + 20


def test_runtime_local_copies_in_memory_and_says_so(policy_dir, capsys):
    from asyncrl.weight_sync import open_weight_sync

    sync = asyncio.run(open_weight_sync(config(policy_dir), None, None))
    assert isinstance(sync, ObjectStoreSync)
    assert "weight_sync.method=collective has nothing to cross with runtime=local" in capsys.readouterr().err


def test_runtime_local_with_a_sharded_learner_copies_in_memory_and_says_so(policy_dir, capsys):
    from asyncrl.weight_sync import open_weight_sync

    sync = asyncio.run(open_weight_sync(config(policy_dir, "learner.world_size=2"), None, None))
    assert isinstance(sync, ObjectStoreSync)  # the engine is in the driver: rank 0's gathered weights, copied
    err = capsys.readouterr().err
    assert "weight_sync.method=collective has nothing to cross with runtime=local" in err
    assert "learner rank 0 publishes the gathered weights" in err


@pytest.mark.slow
def test_a_sharded_learner_sends_from_rank_0_and_names_a_worker_that_never_joins(policy_dir):
    """Two learner rank processes (the ``runtime: local`` handle), two engines here: every
    rank gathers, rank 0 broadcasts, and both engines then hold the learner's weights. Then
    a group that rollout worker 1 never joins fails within the timeout, naming it."""
    from asyncrl.runtime.rank_processes import RankProcesses
    from asyncrl.runtime.transport import LearnerRankError

    cfg = config(policy_dir, "learner.world_size=2", "learner.timeout_s=60", "weight_sync.timeout_s=10",
                 "optim.weight_decay=0.1")

    async def scenario():
        learner = LearnerGroup(RankProcesses(cfg, num_threads=1))
        workers = [RolloutWorker(cfg, seed=i) for i in range(2)]
        try:
            await learner.transport.start()
            for w in workers:
                await w.start()
            sync = CollectiveSync(cfg.weight_sync, learner, TwoWorkers(workers), receivers=2)
            try:
                await sync.connect()
                await learner.train_step(pack_batch([Trajectory([5, 6, 7], [8 + i, 9], [1, 1], [-1.0, -1.0], [0, 0])
                                               for i in range(2)], [1.0, -1.0], 0), False)
                expected = fingerprint((await learner.publish()).items())
                assert all(digest != expected for _, digest in await sync.rollout.fingerprints())
                await sync.sync(1, "abort")
                assert await sync.rollout.fingerprints() == [(1, expected)] * 2
            finally:
                await sync.close()

            missing = CollectiveSync(cfg.weight_sync.model_copy(update={"timeout_s": 2}), learner,
                                     TwoWorkers(workers, joining=[0]), receivers=2)
            start = time.monotonic()
            with pytest.raises(LearnerRankError) as failed:
                try:
                    await missing.connect()
                finally:
                    await missing.close()
            return failed.value, time.monotonic() - start
        finally:
            await learner.shutdown()
            for w in workers:
                await w.shutdown()

    error, elapsed = asyncio.run(scenario())
    assert error.rank == 0  # learner rank 0, the sender, names the rollout worker it waited for
    assert "rank 2 (rollout worker 1) did not join the weight-sync group within weight_sync.timeout_s=2 s" in str(error)
    assert elapsed < 2 + 20  # as above: the timeout, generous for a loaded machine, under the 60 s default


def _exchange(tensors: dict[str, torch.Tensor], bucket_mb: float, receivers: int = 2) -> list[dict[str, torch.Tensor]]:
    """Send ``tensors`` once to ``receivers`` threads; every thread and the store end here."""
    sender = WeightSender(receivers=receivers, bucket_mb=bucket_mb, timeout_s=10, host="127.0.0.1")
    got: list = [None] * receivers

    def receive(rank: int) -> None:
        receiver = WeightReceiver(sender.address, rank)
        try:
            receiver.join()
            got[rank - 1] = receiver.receive(7)
        except Exception as exc:
            got[rank - 1] = exc
        finally:
            receiver.close()

    threads = [threading.Thread(target=receive, args=(r,), daemon=True) for r in range(1, receivers + 1)]
    for t in threads:
        t.start()
    try:
        sender.connect(tensors.items())
        sender.send(7, tensors)
    finally:
        for t in threads:
            t.join(timeout=30)
        sender.close()
    assert not any(t.is_alive() for t in threads)
    return got


def test_small_buckets_give_identical_weights():
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(64, 32 + i, generator=g) for i in range(6)}
    tensors["norm.bf16"] = torch.randn(48, generator=g).to(torch.bfloat16)
    tensors["big"] = torch.randn(300, 100, generator=g)  # larger than a bucket: goes alone
    tensors["scalar"] = torch.tensor(3.5)

    small = 16 / 1024  # 16 KiB
    plan = plan_buckets(tensors.items(), int(small * (1 << 20)))
    assert len(plan) > 4 and all(len({tensors[n].dtype for n in b.names}) == 1 for b in plan)
    assert all(b.numel * tensors[b.names[0]].element_size() <= 16 << 10 or len(b.names) == 1 for b in plan)
    assert len(plan_buckets(tensors.items(), 64 << 20)) == 2  # one per dtype

    for received in (*_exchange(tensors, small), *_exchange(tensors, 64)):
        assert not isinstance(received, Exception), received
        assert received.keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def test_a_receiver_that_does_not_answer_a_sync_is_named():
    """Rank 2 joins the group but never takes version 1: the sender names it within the
    timeout, and rank 1, left waiting for the broadcast, gives up later and names the learner."""
    tensors = {"w": torch.ones(4)}
    sender = WeightSender(receivers=2, bucket_mb=1, timeout_s=1, host="127.0.0.1")
    receivers = [WeightReceiver(sender.address, rank) for rank in (1, 2)]
    errors: list[BaseException] = []

    def rank_1() -> None:
        try:
            receivers[0].receive(1)
        except WeightSyncError as exc:
            errors.append(exc)

    joins = [threading.Thread(target=r.join, daemon=True) for r in receivers]
    for t in joins:
        t.start()
    try:
        sender.connect(tensors.items())
        for t in joins:
            t.join(timeout=10)
        waiting = threading.Thread(target=rank_1, daemon=True)
        waiting.start()
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"rank 2 \(rollout worker 1\) did not get ready for the weight "
                                                  r"sync of version 1 within weight_sync.timeout_s=1 s"):
            sender.send(1, tensors)
        assert time.monotonic() - start < 1 + 10  # the 1 s timeout, generous for a loaded machine
        waiting.join(timeout=10)
        assert len(errors) == 1 and "rank 0 (the learner) did not start sending version 1" in str(errors[0])
    finally:
        for r in receivers:
            r.close()
        sender.close()


# ------------------------------------------------------------------------- Ray
ray = pytest.importorskip("ray")

RAY = ["runtime=ray", "ray.num_cpus=2", "ray.num_rollout_workers=2", "ray.worker_cpus=0.5", "ray.learner_cpus=1"]


@pytest.fixture(scope="module")
def ray_cluster():
    """One local cluster for this module's Ray tests (a run joins it rather than starting
    its own, and leaves it up); shut down after the last one."""
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_collective_sync_to_two_ray_workers(policy_dir, ray_cluster):
    from asyncrl.runtime import start
    from asyncrl.runtime.ray_runtime import RayActors

    cfg = config(policy_dir, *RAY, "mode=sync", "weight_sync.bucket_mb=0.05")

    async def scenario():
        async with start(cfg, model=None, tokenizer=None, train=True) as runtime:
            assert isinstance(runtime.weight_sync, CollectiveSync)
            learner = runtime.learner
            assert isinstance(learner, LearnerGroup) and isinstance(learner.transport, RayActors)
            await learner.train_step(pack_batch([Trajectory([5, 6, 7], [8 + i, 9], [1, 1], [-1.0, -1.0], [0, 0])
                                           for i in range(2)], [1.0, -1.0], 0), False)
            expected = fingerprint(ray.get((await learner.publish()).ref).items())  # publish: in the store
            assert all(digest != expected for _, digest in await runtime.rollout.apply(served_fingerprint))
            await runtime.weight_sync.sync(1, "off")
            assert await runtime.rollout.apply(served_fingerprint) == [(1, expected)] * 2
            episodes = await runtime.rollout.run_group(next(iter_countdown(seed=3)), 4)
            assert {v for e in episodes for t in e.trajectories for v in t.versions} == {1}

    asyncio.run(scenario())


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_train_on_ray_with_collective_weight_sync(tmp_path, policy_dir, ray_cluster, capsys):
    out = tmp_path / "collective"
    assert main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "mode=async", "max_staleness=2", "partial_rollout=abort", "total_steps=4", "batch_size=2",
                 "group_size=4", "eval.num_tasks=4", "eval.samples_per_task=2", "eval_every=2", "task.num_train=64",
                 "task.num_validation=8", "algorithm.filter_zero_variance=false", *RAY,
                 "weight_sync=collective", "weight_sync.timeout_s=30"]) == 0
    assert "runtime ray, engine torch, weight sync collective" in capsys.readouterr().err
    metrics, samples = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "samples.jsonl")
    assert [m["step"] for m in metrics] == [m["version"] for m in metrics] == list(range(5))
    assert len(samples) == 4 * 2 * 4
    assert max(s["trained_version"] - s["behavior_version_min"] for s in samples) <= 2
    assert max(s["behavior_version_max"] for s in samples) >= 1  # the engines served synced versions
    assert "eval/reward_mean" in metrics[2] and "eval/reward_mean" in metrics[4]
    syncs = [e for e in read_jsonl(out / "timeline.jsonl") if e["kind"] == "sync"]
    assert [(e["version"], e["method"]) for e in syncs] == [(v, "collective") for v in range(1, 5)]


@pytest.mark.slow
def test_bench_sync_runs_both_methods_and_checks_the_weights(tmp_path, ray_cluster, capsys):
    from asyncrl.bench import run_bench

    result = run_bench("sync", ["generated=false", "workers=[1]", "repeats=1", "bucket_mb=0.5"], str(tmp_path))
    (row,) = result["results"]
    assert row["model"] == "countdown-tiny" and row["workers"] == 1
    assert row["object_store_s"] > 0 and row["collective_s"] > 0
    assert row["object_store_over_collective"] == pytest.approx(row["object_store_s"] / row["collective_s"])
    assert json.loads((tmp_path / "bench.json").read_text())["results"][0]["workers"] == 1
    assert "object/collective" in capsys.readouterr().out


# ------------------------------------------------- a sharded learner as the sender
AFTER_SYNC: list[tuple[int, str, list[tuple[int, str]]]] = []


async def fingerprints_after_sync(event):
    """``hooks.on_policy_updated``: the learner's weights (gathered by its ranks) and every
    engine's, digested right after the sync of ``event.version``."""
    weights = ray.get((await event.run.learner.publish()).ref)
    AFTER_SYNC.append((event.version, fingerprint(weights.items()), await event.run.rollout.apply(served_fingerprint)))


@pytest.mark.slow
def test_train_on_ray_with_two_learner_ranks_and_collective_weight_sync(tmp_path, policy_dir, ray_cluster, capsys):
    """Learner rank 0 (an actor) sends; rank 1 takes part in each gather and returns."""
    AFTER_SYNC.clear()
    out = tmp_path / "sharded"
    assert main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "learner.world_size=2", "mode=async", "max_staleness=1", "partial_rollout=abort", "total_steps=3",
                 "batch_size=2", "group_size=2", "eval_every=3", "eval.num_tasks=2", "eval.samples_per_task=1",
                 "task.num_train=32", "task.num_validation=4", "algorithm.filter_zero_variance=false",
                 "optim.micro_batch_size=4", "optim.weight_decay=0.1", *RAY, "ray.learner_cpus=0.5",
                 "weight_sync=collective",
                 "weight_sync.timeout_s=30", "weight_sync.bucket_mb=0.05",
                 "hooks.on_policy_updated=test_weight_sync:fingerprints_after_sync"]) == 0
    assert "runtime ray, engine torch, weight sync collective" in capsys.readouterr().err
    metrics, samples = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "samples.jsonl")
    assert [m["step"] for m in metrics] == [m["version"] for m in metrics] == list(range(4))
    assert all(m["staleness/max"] <= 1 for m in metrics[1:])
    assert len(samples) == 3 * 2 * 2
    assert max(s["trained_version"] - s["behavior_version_min"] for s in samples) <= 1
    assert "eval/reward_mean" in metrics[3]
    syncs = [e for e in read_jsonl(out / "timeline.jsonl") if e["kind"] == "sync"]
    assert [(e["version"], e["method"]) for e in syncs] == [(v, "collective") for v in range(1, 4)]
    assert [v for v, _, _ in AFTER_SYNC] == [1, 2, 3]
    for version, learner, engines in AFTER_SYNC:  # both engines hold the learner's weights of that version
        assert engines == [(version, learner)] * 2
    assert len({learner for _, learner, _ in AFTER_SYNC}) == 3  # changed every step (weight decay, at least)
