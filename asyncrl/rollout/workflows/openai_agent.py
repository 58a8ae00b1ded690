"""``workflow.name: openai_agent``: train an agent written against the OpenAI API.

The agent is the user's own code — ``async def run(task, base_url) -> float`` returning
the episode's reward (a plain function is run on a thread of the run's own pool, a class
is built once and its ``run`` used) — named by ``workflow.agent``. Each episode gets its
own gateway session; every model call the agent makes there is recorded into the episode's
trajectories, which train like any other. An agent that raises or hangs is an error
episode under the usual timeout and retry rules, and its session is closed either way; a
plain function that hangs is abandoned on its thread (``asyncrl/threads.py``), which
neither keeps its slot nor keeps the process from exiting.
The episode's ``metadata["agent"]`` holds what the gateway saw of it
(:class:`~asyncrl.types.AgentDiagnostics`; ``Session.diagnostics`` says how each is told),
and ``timings["sandbox_s"]`` the wall seconds of the agent's ``asyncrl.tools.sandbox`` runs
(tools and reward), where it ran any.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from asyncrl.rollout.client import LLMClient
from asyncrl.rollout.gateway.server import Gateway
from asyncrl.tasks.base import Task
from asyncrl.threads import call_in_thread, describe
from asyncrl.tools.sandbox import recording_seconds
from asyncrl.types import AgentDiagnostics, Episode


class OpenAIAgentWorkflow:
    def __init__(self, agent: Callable[[Task, str], Any], gateway: Gateway | None) -> None:
        """``gateway`` is None where the workflow is only being checked (pre-flight)."""
        if inspect.isclass(agent):
            agent = agent().run
        if not callable(agent):
            raise ValueError(f"the agent {agent!r} is not callable")
        self.agent, self.gateway = agent, gateway
        self.name = f"agent {describe(agent)}"  # what a stuck thread is listed as

    async def run(self, task: Task, llm: LLMClient) -> Episode:
        if self.gateway is None:
            raise RuntimeError("openai_agent needs the rollout worker's gateway, which is not running")
        diagnostics: list[AgentDiagnostics] = []
        with recording_seconds() as sandbox_s:
            async with self.gateway.session(llm, on_close=diagnostics.append) as base_url:
                if inspect.iscoroutinefunction(self.agent):
                    reward = await self.agent(task, base_url)
                else:  # a synchronous agent blocks: off the loop that serves its requests (the episode times it out)
                    reward = await call_in_thread(self.agent, task, base_url, timeout_s=None, what=self.name,
                                                  task_id=task.id)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):  # finite: the orchestrator's check
            raise TypeError(f"the agent returned {reward!r} for task {task.id}; expected a float reward")
        for trajectory in llm.trajectories:
            trajectory.reward = float(reward)
        return Episode(task_id=task.id, trajectories=llm.trajectories, reward=float(reward),
                       timings={"sandbox_s": sum(sandbox_s)} if sandbox_s else {},  # asyncrl.tools.sandbox's runs
                       metadata={"calls": sum(len(t.steps) for t in llm.trajectories),
                                 "agent": diagnostics[0].to_dict()})
