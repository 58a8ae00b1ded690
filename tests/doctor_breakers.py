"""Things that break one invariant each, named in a run's config for ``tests/test_doctor.py``."""

from __future__ import annotations

from asyncrl.rollout.client import LLMClient
from asyncrl.rollout.workflows import WorkflowContext
from asyncrl.rollout.workflows.single_turn import SingleTurnWorkflow
from asyncrl.tasks import Task
from asyncrl.types import Episode


def constant(task, response: str) -> float:
    """A reward that cannot tell samples apart: every group scores the same."""
    return 1.0


class EveryFourthWithoutModelTokens(SingleTurnWorkflow):
    """Single-turn, but every fourth episode's trajectory comes back with no model token
    (as if all it held were a tool's output): an episode with nothing to train."""

    def __init__(self, ctx: WorkflowContext) -> None:
        super().__init__(ctx.reward_fn, use_chat_template=ctx.use_chat_template, reward_timeout_s=ctx.reward_timeout_s)
        self.episodes = 0

    async def run(self, task: Task, llm: LLMClient) -> Episode:
        episode = await super().run(task, llm)
        self.episodes += 1
        if self.episodes % 4 == 0:
            for t in episode.trajectories:
                t.loss_mask = [0] * len(t.loss_mask)
        return episode
