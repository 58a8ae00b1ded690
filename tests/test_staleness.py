"""The staleness gate: the quota rule, quota release on rejection, and the async wrapper."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.orchestrator import AsyncStalenessGate, StalenessGate

START, ACCEPT, REJECT_RUNNING, REJECT_ACCEPTED, LEARN = range(5)


@dataclass
class Group:
    start_version: int
    accepted: bool = False


def _check_invariants(gate: StalenessGate, eta: int, b: int, live: list[Group], consumed: int,
                      rejected: int) -> None:
    assert gate.rejected == rejected and gate.started == len(live) + consumed
    assert gate.started <= (eta + gate.version + 1) * b
    assert gate.capacity == (eta + gate.version + 1) * b - gate.started
    assert gate.can_start() == (gate.capacity > 0)
    assert gate.running == sum(not g.accepted for g in live)
    assert gate.accepted == sum(g.accepted for g in live) + consumed


@settings(max_examples=200, deadline=None)
@given(
    eta=st.integers(0, 4),
    b=st.integers(1, 5),
    # Small picks favour the oldest groups so that start-order consumption often makes progress.
    ops=st.lists(st.tuples(st.sampled_from([START, START, START, ACCEPT, ACCEPT, ACCEPT, REJECT_RUNNING,
                                            REJECT_ACCEPTED, LEARN, LEARN]),
                           st.integers(0, 7)), min_size=60, max_size=200),
)
def test_any_interleaving_keeps_the_rule(eta, b, ops):
    gate = StalenessGate(eta, b)
    live: list[Group] = []  # started, not rejected, not consumed; in start order
    consumed = rejected = 0
    for op, pick in ops:
        running = [g for g in live if not g.accepted]
        accepted = [g for g in live if g.accepted]
        if op == START:
            if gate.can_start():
                gate.on_start()
                live.append(Group(gate.version))
            else:
                with pytest.raises(RuntimeError):
                    gate.on_start()
        elif op == ACCEPT and running:
            running[pick % len(running)].accepted = True
            gate.on_accept()
        elif op in (REJECT_RUNNING, REJECT_ACCEPTED):
            pool = running if op == REJECT_RUNNING else accepted
            if not pool:
                continue
            live.remove(pool[pick % len(pool)])
            before = gate.capacity
            gate.on_reject(was_accepted=op == REJECT_ACCEPTED)
            rejected += 1
            # started never exceeds the limit, so nothing else caps capacity: the release is exact.
            assert gate.capacity == before + 1
        elif op == LEARN:
            # Start-order consumption: the B oldest live groups, and only once all of them are done.
            batch = live[:b]
            if len(batch) < b or not all(g.accepted for g in batch):
                continue
            for g in batch:
                assert gate.version - g.start_version <= eta
            del live[:b]
            consumed += b
            gate.on_version(gate.version + 1)
        _check_invariants(gate, eta, b, live, consumed, rejected)


def test_rejected_groups_release_quota_without_a_version_bump():
    """Regression: filtered groups must stop counting, or the learner waits forever."""
    gate = StalenessGate(max_staleness=0, groups_per_step=2)
    gate.on_start()
    gate.on_start()
    assert not gate.can_start()
    gate.on_reject()
    gate.on_reject()
    assert gate.capacity == 2
    gate.on_start()
    gate.on_start()
    assert not gate.can_start()
    # Same for accepted groups the buffer drops later.
    gate.on_accept()
    gate.on_reject(was_accepted=True)
    assert gate.capacity == 1 and gate.version == 0 and gate.rejected == 3


@pytest.mark.parametrize("b", [1, 2, 5])
def test_eta_zero_is_synchronous(b):
    gate = StalenessGate(max_staleness=0, groups_per_step=b)
    for _ in range(b):
        gate.on_start()
    for _ in range(b):
        assert not gate.can_start()
        gate.on_accept()
    gate.on_version(0)  # republishing the same version grants nothing
    assert not gate.can_start()
    gate.on_version(1)
    assert gate.capacity == b


def test_one_step_off_allows_one_batch_ahead():
    gate = StalenessGate(max_staleness=1, groups_per_step=3)
    assert gate.capacity == 6
    gate.on_version(1)
    assert gate.capacity == 9


def test_out_of_order_consumption_can_exceed_eta():
    """Why the buffer must also check ages: the gate bounds the count, not the age."""
    gate = StalenessGate(max_staleness=1, groups_per_step=1)
    gate.on_start()  # slow group, started at version 0
    slow_start = gate.version
    for v in range(3):
        gate.on_start()
        gate.on_accept()  # a young group finishes first and is consumed
        gate.on_version(v + 1)
    gate.on_accept()  # the slow group lands now
    assert gate.version - slow_start > gate.max_staleness


def test_misuse_raises():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(-1, 1)
    with pytest.raises(ValueError, match="groups_per_step"):
        StalenessGate(0, 0)
    with pytest.raises(ValueError, match="version"):
        StalenessGate(0, 1, version=-1)
    gate = StalenessGate(0, 1)
    with pytest.raises(RuntimeError):
        gate.on_accept()
    with pytest.raises(RuntimeError):
        gate.on_reject()
    with pytest.raises(RuntimeError):
        gate.on_reject(was_accepted=True)
    gate.on_start()
    with pytest.raises(RuntimeError):
        gate.on_start()
    gate.on_accept()
    with pytest.raises(RuntimeError):
        gate.on_accept()  # more accepts than starts
    gate.on_version(3)
    with pytest.raises(ValueError):
        gate.on_version(2)
    assert (gate.version, gate.running, gate.accepted, gate.rejected) == (3, 0, 1, 0)


def test_a_resumed_gate_holds_the_accepted_quota_and_nothing_running():
    # at version 4 with η = 1, B = 2: 5 consumed or buffered groups leave room for 7
    resumed = StalenessGate.resumed(1, 2, version=4, accepted=5)
    assert resumed.running == 0 and resumed.accepted == 5 and resumed.rejected == 0
    assert resumed.limit == 12 and resumed.capacity == 7
    # A smaller η on resume can leave started above the limit: capacity clamps at zero.
    shrunk = StalenessGate.resumed(0, 2, version=0, accepted=4)
    assert shrunk.started == 4 and shrunk.limit == 2
    assert shrunk.capacity == 0 and not shrunk.can_start()
    with pytest.raises(ValueError, match="accepted"):
        StalenessGate.resumed(1, 2, version=4, accepted=-1)


async def _pending(task: asyncio.Task, rounds: int = 5) -> bool:
    for _ in range(rounds):
        await asyncio.sleep(0)
    return not task.done()


def test_async_acquire_wakes_on_version():
    async def main():
        gate = AsyncStalenessGate(StalenessGate(0, 1))
        await gate.acquire()
        waiter = asyncio.create_task(gate.acquire())
        assert await _pending(waiter)
        await gate.accept()
        assert await _pending(waiter)  # accepting does not free quota
        await gate.set_version(1)
        await asyncio.wait_for(waiter, 1)
        assert gate.gate.running == 1 and gate.gate.accepted == 1

    asyncio.run(main())


def test_async_acquire_wakes_on_rejection():
    async def main():
        gate = AsyncStalenessGate(StalenessGate(0, 1))
        await gate.acquire()
        waiter = asyncio.create_task(gate.acquire())
        assert await _pending(waiter)
        await gate.release_rejected()
        await asyncio.wait_for(waiter, 1)
        assert gate.gate.running == 1 and gate.gate.version == 0

    asyncio.run(main())


def test_async_cancelled_waiter_takes_no_quota():
    async def main():
        gate = AsyncStalenessGate(StalenessGate(0, 1))
        await asyncio.wait_for(gate.acquire(), 1)
        assert gate.gate.running == 1 and not gate.gate.can_start()
        # Cancelled while waiting.
        waiter = asyncio.create_task(gate.acquire())
        assert await _pending(waiter)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # Cancelled right after being notified, before it could run again.
        waiter = asyncio.create_task(gate.acquire())
        assert await _pending(waiter)
        await gate.release_rejected()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.gate.running == 0 and gate.gate.capacity == 1
        # The quota is still there for the next caller.
        await asyncio.wait_for(gate.acquire(), 1)
        assert gate.gate.running == 1

    asyncio.run(main())


def test_the_modes_are_the_configs_modes():
    """``config.py`` spells its literals out (the key reference renders them as written), so
    the ground-floor definitions must not drift from them."""
    from typing import get_args

    from asyncrl.config import ScheduleConfig
    from asyncrl.modes import Mode, PartialRollout

    assert get_args(Mode) == get_args(ScheduleConfig.model_fields["mode"].annotation)
    assert get_args(PartialRollout) == get_args(ScheduleConfig.model_fields["partial_rollout"].annotation)
