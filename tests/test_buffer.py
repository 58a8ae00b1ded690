"""The buffer hands out oldest-started groups first and never one older than η."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.orchestrator.buffer import GroupBuffer, ReadyGroup, trainable
from asyncrl.orchestrator.staleness import AsyncStalenessGate, StalenessGate
from asyncrl.types import Episode, Group, Trajectory


def ready(task_id: str, version: int, order: int) -> ReadyGroup:
    t = Trajectory([1], [2, 3], [1, 1], [-1.0, -1.0], [version, version + 1])
    return ReadyGroup(Group(task_id, [Episode(task_id, [t], reward=1.0)], [0.5]), order)


def test_oldest_started_first_and_stale_dropped_with_quota_released():
    async def main():
        gate = AsyncStalenessGate(StalenessGate(max_staleness=1, groups_per_step=2))
        buffer = GroupBuffer(gate)
        for _ in range(4):
            await gate.acquire()
        await gate.set_version(2)
        await buffer.put(ready("young-late", 2, order=4))
        await buffer.put(ready("stale", 0, order=1))
        await buffer.put(ready("young-early", 1, order=3))
        started_before = gate.gate.started
        taken = await buffer.take(2, trained_version=2)
        assert [r.group.task_id for r in taken] == ["young-early", "young-late"]
        assert buffer.stale_dropped == 1 and len(buffer) == 0
        assert gate.gate.started == started_before - 1  # the stale group's quota came back

        waiter = asyncio.create_task(buffer.take(1, trained_version=2))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # waits for a fresh group
        await gate.acquire()
        await buffer.put(ready("fresh", 2, order=5))
        assert [r.group.task_id for r in await waiter] == ["fresh"]

    asyncio.run(main())


def test_before_the_first_take_one_batch_holds_quota_and_a_rejection_or_the_take_frees_room():
    """``hold_to_first_batch``: at the start the gate admits (1 + η)·B = 6 groups, but only B = 2
    may hold quota until the learner takes its first batch; a filtered group's quota counts
    free again (the batch still fills); after the take the gate's limit alone holds."""
    async def main():
        gate = AsyncStalenessGate(StalenessGate(max_staleness=2, groups_per_step=2))
        buffer = GroupBuffer(gate)

        async def start() -> None:
            await buffer.hold_to_first_batch()
            await gate.acquire()

        await start()
        await start()
        third = asyncio.create_task(start())
        await asyncio.sleep(0.01)
        assert not third.done() and gate.gate.started == 2 and gate.gate.can_start()  # the gate alone would admit
        await buffer.reject(start_order=2)  # filtered: its quota back, a third group may take its place
        await asyncio.wait_for(third, 1)
        assert gate.gate.started == 2
        await buffer.put(ready("a", 0, order=1))
        await buffer.put(ready("b", 0, order=3))
        fourth = asyncio.create_task(start())
        await asyncio.sleep(0.01)
        assert not fourth.done()
        assert [r.group.task_id for r in await buffer.take(2, trained_version=0)] == ["a", "b"]
        await asyncio.wait_for(fourth, 1)
        for _ in range(3):  # no hold after the first take: the gate's limit, (η + 1)·B = 6, alone
            await asyncio.wait_for(start(), 1)
        assert gate.gate.started == 6 and not gate.gate.can_start()

    asyncio.run(main())


def test_a_group_short_of_advantages_is_refused_naming_it_not_trained_in_part():
    whole = ready("whole", 0, order=1)
    episodes = [*whole.group.episodes, *ready("x", 0, order=2).group.episodes]
    short = ReadyGroup(Group("short", episodes, [0.5]), 2)  # two episodes, one advantage
    unscored = ReadyGroup(Group("unscored", episodes[:1]), 3)  # advantages None
    assert len(trainable([whole], 1, 1)[0]) == 1
    for bad in (short, unscored):
        with pytest.raises(ValueError, match=f"task {bad.group.task_id} holds {len(bad.group.episodes)} episodes"):
            trainable([whole, bad], 1, 1)
