"""No group is thrown away as stale (``stale_groups: wait``), and none older than η is trained.

At η > 0 the learner takes what is ready, so a slow group (long responses) can watch
younger ones fill batch after batch until it is older than η; ``stale_groups: drop``
drops it then, ``wait`` (the default) has the learner wait for it at the last step it is
fresh for (``asyncrl/orchestrator/buffer.py``). Checked on a simulated schedule — the
real gate and buffer, groups that take random, long-tailed times and are filtered at
random, the learner taking B groups (or streaming them in) a step — and on a real run of
the long-tail workload, where the drops fall on the longest responses."""

from __future__ import annotations

import asyncio
import json
import random
import statistics

import pytest

from asyncrl.cli import main
from asyncrl.orchestrator.buffer import GroupBuffer, ReadyGroup, trainable
from asyncrl.orchestrator.staleness import AsyncStalenessGate, StalenessGate
from asyncrl.report import load_run, summarize
from asyncrl.tiny import build_char_tokenizer, build_tiny_model, save_tiny_policy
from asyncrl.types import Episode, Group, Trajectory


def ready(order: int, version: int, tokens: int = 2) -> ReadyGroup:
    t = Trajectory([1], [2] * tokens, [1] * tokens, [-1.0] * tokens, [version] * tokens)
    return ReadyGroup(Group(f"task-{order}", [Episode(f"task-{order}", [t], reward=1.0)], [0.5]), order)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def start(gate: AsyncStalenessGate, buffer: GroupBuffer, version: int, *orders: int) -> None:
    """Groups admitted and generating under ``version``."""
    for order in orders:
        await gate.acquire()
        buffer.running(order, version)


def test_the_learner_waits_for_a_group_whose_last_fresh_step_it_is():
    """η = 2, B = 1: three groups start under version 0, the third lands first and is
    trained, a younger one (version 1) lands next. Taking it at step 1 would leave two
    groups due by step 2 for one slot, so ``wait`` waits for an old one; ``drop`` takes
    the young one and later drops an old one."""
    async def schedule(stale_groups):
        gate = AsyncStalenessGate(StalenessGate(max_staleness=2, groups_per_step=1))
        buffer = GroupBuffer(gate, stale_groups=stale_groups)
        await start(gate, buffer, 0, 1, 2, 3)
        await buffer.put(ready(3, 0))
        assert [g.start_order for g in await buffer.take(1, trained_version=0)] == [3]
        await gate.set_version(1)
        await start(gate, buffer, 1, 4)
        await buffer.put(ready(4, 1))
        step1 = asyncio.create_task(buffer.take(1, trained_version=1))
        await settle()
        waited = not step1.done()
        await buffer.put(ready(1, 0))
        trained = [g.start_order for g in await step1]
        await gate.set_version(2)
        await buffer.put(ready(2, 0))
        trained += [g.start_order for g in await buffer.take(1, trained_version=2)]
        await gate.set_version(3)
        await start(gate, buffer, 3, 5)
        await buffer.put(ready(5, 3))
        trained += [g.start_order for g in await buffer.take(1, trained_version=3)]
        return waited, trained, buffer

    waited, trained, buffer = asyncio.run(schedule("wait"))
    assert waited and trained == [1, 2, 4]
    assert buffer.stale_dropped == 0 and buffer.counts["deadline_waits"] == 1

    waited, trained, buffer = asyncio.run(schedule("drop"))
    assert not waited and trained == [4, 1, 5]  # group 2 was older than η by step 3
    assert buffer.stale_dropped == 1 and buffer.counts["stale_dropped_trajectories"] == 1


def test_filtering_the_group_waited_for_ends_the_wait():
    async def main_():
        gate = AsyncStalenessGate(StalenessGate(max_staleness=1, groups_per_step=1))
        buffer = GroupBuffer(gate)
        await start(gate, buffer, 0, 1, 2)
        await buffer.put(ready(2, 0))
        await buffer.take(1, trained_version=0)
        await gate.set_version(1)
        await start(gate, buffer, 1, 3)
        await buffer.put(ready(3, 1))
        step1 = asyncio.create_task(buffer.take(1, trained_version=1))
        await settle()
        assert not step1.done()  # group 1 is due now: taking group 3 would leave it stale
        await buffer.reject(1)  # it was filtered: nothing to wait for
        assert [g.start_order for g in await step1] == [3]

    asyncio.run(main_())


async def simulate(stale_groups: str, eta: int, per_step: int, seed: int, steps: int = 40,
                   streaming: bool = False) -> dict:
    """A schedule in ticks: the real gate and buffer; a group takes 1–3 ticks, or 8–40 for
    one in six (the long tail), its first token comes under the version the engines hold
    then, one in three is filtered; a step trains for 2 ticks. Every trained group is
    checked by ``trainable`` (which raises on one older than η)."""
    rng = random.Random(seed)
    gate = AsyncStalenessGate(StalenessGate(eta, per_step))
    buffer = GroupBuffer(gate, stale_groups=stale_groups)
    running: dict[int, list[int]] = {}  # order -> [finish tick, first-token tick, first-token version]
    version, order, tick, trained, waited_ticks = 0, 0, 0, 0, 0
    batch: list[ReadyGroup] = []
    take: asyncio.Task | None = None
    train_until: int | None = None

    def ask() -> asyncio.Task:
        n = min(per_step - len(batch), max(1, len(buffer))) if streaming else per_step
        return asyncio.create_task(buffer.take(n, version))

    take = ask()
    while trained < steps:
        tick += 1
        assert tick < 20_000, "the schedule stopped making progress"
        for o, (finish, first, first_version) in sorted(running.items()):
            if first == tick:
                running[o][2] = version
            if finish == tick:
                del running[o]
                if rng.random() < 1 / 3:
                    await buffer.reject(o)
                else:
                    await buffer.put(ready(o, first_version, tokens=finish - first + 1))
        await settle()
        if take is not None and take.done():
            groups = take.result()
            trainable(groups, version, eta)  # raises on a group older than η
            batch += groups
            take = None
            if len(batch) < per_step:
                take = ask()
            else:
                batch, train_until = [], tick + 2
        elif take is not None:
            waited_ticks += 1
        if train_until == tick:
            trained, version, train_until = trained + 1, version + 1, None
            await gate.set_version(version)
            take = ask()
        while gate.gate.can_start():
            order += 1
            await start(gate, buffer, version, order)
            duration = rng.randint(8, 40) if rng.random() < 1 / 6 else rng.randint(1, 3)
            first = tick + rng.randint(0, min(duration - 1, 2))
            running[order] = [tick + duration, first, version]
        await settle()
    if take is not None:
        take.cancel()
    return {"stale_dropped": buffer.stale_dropped, "ticks": tick, "waited_ticks": waited_ticks,
            "waits": buffer.counts["deadline_waits"]}


@pytest.mark.parametrize("eta,per_step,streaming", [(1, 1, False), (1, 4, False), (2, 2, False), (3, 4, False),
                                                    (2, 4, True)])
def test_no_group_goes_stale_when_the_learner_waits(eta, per_step, streaming):
    waits, drops = [], []
    for seed in range(6):
        waited = asyncio.run(simulate("wait", eta, per_step, seed, streaming=streaming))
        assert waited["stale_dropped"] == 0, (seed, waited)
        waits.append(waited["waits"])
        drops.append(asyncio.run(simulate("drop", eta, per_step, seed, streaming=streaming))["stale_dropped"])
    assert sum(drops) > 0  # the schedule is one where groups go stale unless the learner waits
    assert sum(waits) > 0


@pytest.fixture(scope="module")
def longtail_policy(tmp_path_factory):
    """Random weights: it rarely stops, so lengths follow the long-tail task's ask."""
    model, tokenizer = build_tiny_model(build_char_tokenizer(), seed=0, max_position_embeddings=256)
    return save_tiny_policy(model, tokenizer, tmp_path_factory.mktemp("longtail") / "policy")


def longtail_run(tmp_path, policy, stale_groups):
    """``bench modes``' long-tail workload (its settings, fewer steps) at η = 1, continue."""
    out, config = tmp_path / stale_groups, tmp_path / "longtail.yaml"
    config.write_text("mode: async\n")
    assert main([
        "train", str(config), f"output_dir={out}", f"model.path={policy}", "task.name=longtail",
        "workflow.use_chat_template=false", "task.num_train=96", "task.num_validation=4", "mode=async",
        "max_staleness=1", "partial_rollout=continue", f"stale_groups={stale_groups}", "total_steps=24",
        "batch_size=4", "group_size=8", "eval_every=0", "eval.num_tasks=4", "eval.samples_per_task=1",
        "sampling.max_tokens=160", "optim.lr=3e-4", "algorithm.filter_zero_variance=false"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return out, metrics[-1], samples


@pytest.mark.slow
def test_a_long_tail_run_drops_its_longest_groups_unless_the_learner_waits(tmp_path, longtail_policy):
    out, last, samples = longtail_run(tmp_path, longtail_policy, "drop")
    dropped = last["buffer/stale_dropped_total"]
    assert dropped > 0 and last["rollout/stale_dropped_trajectories_total"] == 8 * dropped
    dropped_mean = last["rollout/stale_dropped_tokens_total"] / last["rollout/stale_dropped_trajectories_total"]
    assert dropped_mean > 2 * statistics.mean(s["response_tokens"] for s in samples)  # the long ones go
    assert summarize(load_run(out))["groups dropped, stale: older than η when the learner came to it"] == (
        f"{dropped} ({dropped / (last['rollout/groups_accepted_total']):.1%})")

    out, last, samples = longtail_run(tmp_path, longtail_policy, "wait")
    assert last["buffer/stale_dropped_total"] == 0 and last["rollout/stale_dropped_tokens_total"] == 0
    assert max(s["trained_version"] - s["behavior_version_min"] for s in samples) <= 1
    summary = summarize(load_run(out))
    assert summary["groups dropped, stale: older than η when the learner came to it"] == "0 (0.0%)"
    assert summary["learner waits that kept a group from going stale"] == last["rollout/deadline_waits_total"]
