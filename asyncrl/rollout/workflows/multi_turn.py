"""The base of multi-turn workflows: the model speaks, the environment answers, until
the episode is done or the turn limit is reached. Subclasses say what the environment
does; the client keeps the tokens exact and masks the environment's turns."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

from asyncrl.rollout.client import LLMClient, Message, Response
from asyncrl.tasks.base import Task
from asyncrl.types import AgentDiagnostics, Episode, is_tool_error


class MultiTurnWorkflow(ABC):
    tools: list[dict[str, Any]] | None = None

    def __init__(self, *, max_turns: int = 4) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns

    @abstractmethod
    def initial_messages(self, task: Task) -> list[Message]: ...

    @abstractmethod
    async def env_step(self, task: Task, messages: list[Message], response: Response) -> tuple[list[Message], bool]:
        """The environment's answer to the model's last reply: (new messages, done)."""

    @abstractmethod
    async def reward(self, task: Task, messages: list[Message]) -> float: ...

    async def turn_reward(self, task: Task, messages: list[Message], new_messages: list[Message],
                          done: bool) -> float:
        """The reward of the model's latest reply (``messages[-1]``) once the environment has
        answered it (``new_messages``; ``done``: the episode ends there), beside the episode's
        outcome (:meth:`reward`): a per-turn reward (``Step.reward``: on that call's last
        sampled token under a critic's GAE, in the episode's total under a group-relative
        estimator; docs/critic.md). Override to give one; 0, the default, gives none. A reply
        cut at ``max_tokens`` gets no environment answer, so this is not asked for it."""
        return 0.0

    async def run(self, task: Task, llm: LLMClient) -> Episode:
        """``metadata["agent"]``: :class:`~asyncrl.types.AgentDiagnostics`, where a tool call
        is an environment answer the conversation went on with (not the one that ended
        it), its latency the time in ``env_step``, and the episode cut by the turn limit
        when ``max_turns`` replies were made and the environment had not said done."""
        messages = self.initial_messages(task)
        turns = tool_calls = tool_errors = 0
        env_seconds, ended = 0.0, False
        while turns < self.max_turns:
            response = await llm.chat(messages, tools=self.tools)
            turns += 1
            messages = messages + [response.message]
            if response.finish_reason == "length":
                ended = True
                break
            started = time.monotonic()
            new_messages, done = await self.env_step(task, messages, response)
            env_seconds += time.monotonic() - started
            turn_reward = await self.turn_reward(task, messages, new_messages, done)
            if turn_reward:
                llm.set_turn_reward(turn_reward)
            if done:
                ended = True
                break
            messages = messages + new_messages
            tool_calls += 1
            tool_errors += sum(m.get("role") != "assistant" and is_tool_error(m.get("content"))
                               for m in new_messages)
        reward = await self.reward(task, messages)
        for trajectory in llm.trajectories:
            trajectory.reward = reward
        agent = AgentDiagnostics(turns=turns, tool_calls=tool_calls, tool_errors=tool_errors,
                                 tool_latency_s=env_seconds,
                                 model_tokens=sum(t.num_model_tokens for t in llm.trajectories),
                                 cut_by_turn_limit=not ended)
        return Episode(task_id=task.id, trajectories=llm.trajectories, reward=reward,
                       metadata={"turns": turns, "messages": messages, "agent": agent.to_dict()})
