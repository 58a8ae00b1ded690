"""One prompt, one answer, one reward: the workflow of Countdown-style tasks."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from asyncrl.rollout.client import LLMClient
from asyncrl.rollout.workflows.group_reward import GroupMember, GroupReward
from asyncrl.tasks.base import RewardFn, Task
from asyncrl.tasks.reward_forms import ForeignReward, is_async_reward
from asyncrl.tasks.reward_sum import RewardSum, Scored, unwrap
from asyncrl.threads import call_in_thread, describe
from asyncrl.types import Episode


class SingleTurnWorkflow:
    """Ask once (through the chat template, or as a raw prompt), score the answer."""

    def __init__(self, reward_fn: RewardFn, *, use_chat_template: bool = True, reward_timeout_s: float = 10.0):
        self.reward_fn = reward_fn
        self.use_chat_template = use_chat_template
        self.reward_timeout_s = reward_timeout_s
        # TRL's and verl's forms and a weighted list score through a RewardSum (verl's extra keys, each
        # function's value kept); a batched one (TRL's) is called once for a task's episodes that run together
        self.reward_sum = RewardSum([reward_fn]) if isinstance(reward_fn, ForeignReward) else \
            reward_fn if isinstance(reward_fn, RewardSum) else None
        batched = self.reward_sum is not None and self.reward_sum.batched
        self.group_reward = GroupReward(self.reward_sum, timeout_s=reward_timeout_s) if batched else None

    async def run(self, task: Task, llm: LLMClient) -> Episode:
        if self.group_reward is None:
            return await self._run(task, llm, None)
        async with self.group_reward.member(task) as member:
            return await self._run(task, llm, member)

    async def _run(self, task: Task, llm: LLMClient, member: GroupMember | None) -> Episode:
        start = time.perf_counter()
        sampling = llm.sampling
        if "max_tokens" in task.data:  # a task may cap its own response length
            sampling = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, int(task.data["max_tokens"])))
        if self.use_chat_template:  # a dataset's chat messages as they are, else the prompt as the user's turn
            messages = task.messages if task.messages is not None else [{"role": "user", "content": task.prompt}]
            response = await llm.chat(messages, sampling=sampling)
        else:
            response = await llm.generate(task.prompt, sampling=sampling)
        generated = time.perf_counter()
        if member is not None:
            scored = await member.score(task, response.text, response.token_ids)
        elif self.reward_sum is not None:
            scored = unwrap((await self.reward_sum.score_batch([task], [response.text], [response.token_ids],
                                                               timeout_s=self.reward_timeout_s))[0])
        else:
            scored = Scored(await score(self.reward_fn, task, response.text, timeout_s=self.reward_timeout_s))
        for trajectory in llm.trajectories:
            trajectory.reward = scored.reward
        return Episode(task_id=task.id, trajectories=llm.trajectories, reward=scored.reward,
                       rewards=scored.parts, reward_extras=scored.extras,
                       timings={"generate_s": generated - start, "reward_s": time.perf_counter() - generated},
                       metadata={"response": response.text})


async def score(reward_fn: RewardFn, task: Task, text: str, *, timeout_s: float) -> float:
    """Run a user's reward function safely and insist on a number. Whether it is finite and
    in range is the orchestrator's check (``asyncrl/algorithms/finite.py``), which stops the
    run: retrying would give the same NaN again. It runs on the episode's pool of daemon
    threads (``asyncrl/threads.py``): past ``timeout_s`` it is abandoned there, and never
    keeps a run from stopping. An ``async def`` reward (asyncrl's, TRL's or verl's) is
    awaited on the event loop instead, under the same timeout."""
    if is_async_reward(reward_fn):  # awaited on the event loop, under the same timeout
        async with asyncio.timeout(timeout_s):
            value = await reward_fn(task, text)
    else:
        value = await call_in_thread(reward_fn, task, text, timeout_s=timeout_s,
                                     what=f"reward function {describe(reward_fn)}", task_id=task.id)
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"reward function {name} returned {value!r} for task {task.id}; expected a float")
    return float(value)
