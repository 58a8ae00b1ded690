"""The base of multi-turn workflows: the model speaks, the environment answers, until
the episode is done or the turn limit is reached. Subclasses say what the environment
does; the client keeps the tokens exact and masks the environment's turns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from asyncrl.client import LLMClient, Message, Response
from asyncrl.tasks.base import Task
from asyncrl.types import Episode


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

    async def run(self, task: Task, llm: LLMClient) -> Episode:
        messages = self.initial_messages(task)
        turns = 0
        while turns < self.max_turns:
            response = await llm.chat(messages, tools=self.tools)
            turns += 1
            messages = messages + [response.message]
            if response.finish_reason == "length":
                break
            new_messages, done = await self.env_step(task, messages, response)
            if done:
                break
            messages = messages + new_messages
        reward = await self.reward(task, messages)
        for trajectory in llm.trajectories:
            trajectory.reward = reward
        return Episode(task_id=task.id, trajectories=llm.trajectories, reward=reward,
                       metadata={"turns": turns, "messages": messages})
