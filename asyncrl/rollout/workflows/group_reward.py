"""One reward call for a group: a batched reward function (TRL's, verl's batched form), or a
weighted list holding one, scores the completions of a task's episodes that run together
in one call, as TRL calls it with a generation batch.

Episodes run one by one (``run_episode``: each its own retries and timeout), so the
group is gathered here rather than handed over whole: an episode enters before it
generates, hands in its completion, and waits; the call is made when every episode that
entered has handed in or left (failed, cancelled). Nothing waits for an episode that has
not started, so an episode never waits on one it could block (``rollout.max_concurrent_
episodes`` admits a group's episodes in turns, and each turn is then its own call), and a
call of part of a group is still correct: a TRL reward scores each completion on its own
row, batching only saves calls. A call that raises, or runs past the reward timeout,
fails every episode in it, each then retried as an episode whose reward raised is. The
price: an episode waits for its slowest sibling within its own ``workflow.timeout_s``, as
a TRL step waits for its slowest generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from asyncrl.tasks.base import Task
from asyncrl.tasks.reward_sum import RewardSum, Scored


@dataclass(eq=False)
class _Batch:
    members: int = 0  # entered and not left without handing in
    items: list[tuple[Task, str, list[int], asyncio.Future[Scored]]] = field(default_factory=list)


class GroupReward:
    """Gathers the completions of one task's concurrent episodes into one reward call."""

    def __init__(self, reward: RewardSum, *, timeout_s: float) -> None:
        self.reward, self.timeout_s = reward, timeout_s
        self.calls = 0  # reward calls made (for tests and curiosity: one per group when all run together)
        self._open: dict[str, _Batch] = {}
        self._running: set[asyncio.Task[None]] = set()  # the calls under way, referenced until done

    @contextlib.asynccontextmanager
    async def member(self, task: Task) -> AsyncIterator[GroupMember]:
        """One episode's place in its task's batch, from before it generates until it has its reward."""
        batch = self._open.setdefault(task.id, _Batch())
        batch.members += 1
        member = GroupMember(self, task.id, batch)
        try:
            yield member
        finally:
            if not member.handed_in:  # failed or cancelled before its completion: the others go on
                batch.members -= 1
                self._maybe_call(task.id, batch)

    def _maybe_call(self, key: str, batch: _Batch) -> None:
        if self._open.get(key) is not batch:
            return  # its call was made already
        if batch.members == 0:
            del self._open[key]
        elif len(batch.items) == batch.members:
            del self._open[key]  # episodes entering from now on make the next batch
            call = asyncio.ensure_future(self._call(batch))
            self._running.add(call)
            call.add_done_callback(self._running.discard)

    async def _call(self, batch: _Batch) -> None:
        tasks, texts, ids, futures = (list(column) for column in zip(*batch.items))
        self.calls += 1
        try:
            scores = await self.reward.score_batch(tasks, texts, ids, timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 (the user's code: every episode of the call fails with it)
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
            return
        for future, value in zip(futures, scores):
            if future.done():
                continue
            if isinstance(value, TypeError):  # no function scored this one: it alone fails
                future.set_exception(value)
            else:
                future.set_result(value)


class GroupMember:
    def __init__(self, owner: GroupReward, key: str, batch: _Batch) -> None:
        self.owner, self.key, self.batch = owner, key, batch
        self.handed_in = False

    async def score(self, task: Task, text: str, token_ids: list[int]) -> Scored:
        """This episode's reward, once the batch's call is made."""
        future: asyncio.Future[Scored] = asyncio.get_running_loop().create_future()
        self.batch.items.append((task, text, token_ids, future))
        self.handed_in = True
        self.owner._maybe_call(self.key, self.batch)
        return await asyncio.shield(future)  # a cancelled episode leaves the call to the others
