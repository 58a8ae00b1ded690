"""One prompt, one answer, one reward: the workflow of Countdown-style tasks."""

from __future__ import annotations

import dataclasses
import time

from asyncrl.rollout.client import LLMClient
from asyncrl.tasks.base import RewardFn, Task
from asyncrl.threads import call_in_thread, describe
from asyncrl.types import Episode


class SingleTurnWorkflow:
    """Ask once (through the chat template, or as a raw prompt), score the answer."""

    def __init__(self, reward_fn: RewardFn, *, use_chat_template: bool = True, reward_timeout_s: float = 10.0):
        self.reward_fn = reward_fn
        self.use_chat_template = use_chat_template
        self.reward_timeout_s = reward_timeout_s

    async def run(self, task: Task, llm: LLMClient) -> Episode:
        start = time.perf_counter()
        sampling = llm.sampling
        if "max_tokens" in task.data:  # a task may cap its own response length
            sampling = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, int(task.data["max_tokens"])))
        if self.use_chat_template:
            response = await llm.chat([{"role": "user", "content": task.prompt}], sampling=sampling)
        else:
            response = await llm.generate(task.prompt, sampling=sampling)
        generated = time.perf_counter()
        reward = await score(self.reward_fn, task, response.text, timeout_s=self.reward_timeout_s)
        for trajectory in llm.trajectories:
            trajectory.reward = reward
        return Episode(task_id=task.id, trajectories=llm.trajectories, reward=reward,
                       timings={"generate_s": generated - start, "reward_s": time.perf_counter() - generated},
                       metadata={"response": response.text})


async def score(reward_fn: RewardFn, task: Task, text: str, *, timeout_s: float) -> float:
    """Run a user's reward function safely and insist on a number. Whether it is finite and
    in range is the orchestrator's check (``asyncrl/algorithms/finite.py``), which stops the
    run: retrying would give the same NaN again. It runs on the episode's pool of daemon
    threads (``asyncrl/threads.py``): past ``timeout_s`` it is abandoned there, and never
    keeps a run from stopping."""
    value = await call_in_thread(reward_fn, task, text, timeout_s=timeout_s,
                                 what=f"reward function {describe(reward_fn)}", task_id=task.id)
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"reward function {name} returned {value!r} for task {task.id}; expected a float")
    return float(value)
